"""A word-level tokenizer for the demo world, built in code and saved as an ordinary Hugging Face tokenizer.

Choices:
1. One token per word (``tokenizers`` ``WordLevel``): the corpus has about 250 words, so the
   embedding table stays tiny and every token is a readable word in logs.
2. The ``Whitespace`` pre-tokenizer also splits punctuation from words, so a typed prompt such as
   ``"the dog."`` still maps onto the corpus words ``the dog .``.
3. Encoding adds ``<bos>`` in front (a template post-processor), exactly as in pretraining, so a
   prompt encoded by the pipeline looks like the start of a training sequence. ``<eos>`` is never
   added: the model itself must end its response.
4. The decoder joins tokens with single spaces and does no clean-up, so ``decode`` gives back the
   corpus text (``"... the river ."``) and ``gold_score`` sees the same words the model produced.
5. Special ids are fixed: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3; padding is on the left,
   as batched generation needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


def build_tokenizer(words: Iterable[str], *, model_max_length: int = 64) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``words`` (ids 4, 5, ... in the given order) plus the special tokens.

    Args:
        words: the vocabulary, each word once; order fixes the ids.
        model_max_length: longest sequence the model accepts (its ``n_positions``).

    Returns:
        A fast tokenizer with ``padding_side="left"``; save it with ``save_pretrained`` and load it
        back with ``AutoTokenizer.from_pretrained``.
    """
    vocabulary = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for word in words:
        if word in vocabulary:
            raise ValueError(f"`words` must be distinct and must not contain special tokens, got {word!r} twice")
        vocabulary[word] = len(vocabulary)
    backend = Tokenizer(models.WordLevel(vocab=vocabulary, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
