"""Explicit Arrow schemas and column names for every table the pipeline writes.

Conventions:

1. Token ids are ``list<int32>`` and per-token floats ``list<float32>``; every per-token list of
   a row has the length of that row's response action tokens (``len(response_ids)``), with no
   padding stored. Padding is re-created on read (:mod:`storage.experience_io`).
2. Top-level columns are non-nullable: a missing value is an error, never a silent null. The one
   exception says something: ``old_values`` is null in every row of a rollout without a critic.
3. ``SCHEMA_VERSION`` goes into every manifest and every input key; bump it whenever a schema
   changes so old outputs are recomputed rather than misread.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = 7
"""2: experience columns renamed to the names of the maths (``old_logprobs``, ``ref_logprobs``,
``old_values``, ``rewards``) and manifests record the code fingerprint and the runtime.
3: prompts, candidates and preferences keep chat prompts as ``messages``; manifests mark prunable files.
4: ``old_values`` is null in every row of a rollout made without a critic (critic-free estimators);
``prompt_id`` is also the group of each row (``Experience.group_ids``).
5: the sampler's own log-probs are kept beside the trainer's (``engine_logprobs``, the generation engine's;
``sampling.engine``): in every rollout, and in candidates and evaluation pieces sampled by vLLM, with the
trainer's ``old_logprobs`` there. Migration: as for every bump, an unfinished iteration's outputs of schema 4
are recomputed; finished iterations are kept as they are (a campaign is history).
6: experience keeps the version of the policy that sampled each row (``policy_version``, ``sampling.staleness``).
Experience of schema 5 is still read (replayed): it has no such column, and its rows are on-policy.
7: experience may hold multi-turn episodes (``environment.class``): ``response_ids`` is the whole response window, the
model's and the environment's tokens, ``action_mask`` is True at the model's tokens (null: every response token is
the model's, a single-turn row) and ``turn_rewards`` the reward of each model turn (null for a single-turn row); the
rollout of episodes writes a second table, ``turns`` (:data:`TURNS`). Experience of schema 5 and 6 is still read: it
has neither column, and reads as single-turn rows."""

READABLE_SCHEMA_VERSIONS = (5, 6, SCHEMA_VERSION)
"""The schema versions this version reads: its own, and 5 and 6, whose tables differ only by experience's
``policy_version`` column (5: read as on-policy rows) and its episode columns (``action_mask`` and ``turn_rewards``:
read as single-turn rows; :mod:`storage.experience_io`), so a campaign of older iterations continues and replays
them."""

# Column names: one name per concept, identical to the Experience field it stores where one exists.
PROMPT_ID = "prompt_id"
PROMPT = "prompt"
MESSAGES = "messages"
CANDIDATE_INDEX = "candidate_index"
RESPONSE = "response"
PROMPT_IDS = "prompt_ids"
RESPONSE_IDS = "response_ids"
PAIR_ID = "pair_id"
CHOSEN = "chosen"
REJECTED = "rejected"
CHOSEN_IDS = "chosen_ids"
REJECTED_IDS = "rejected_ids"
MARGIN = "margin"
EXAMPLE_ID = "example_id"
COMPLETION = "completion"
LABELER = "labeler"
CHOICE = "choice"
ROW = "row"
OLD_LOGPROBS = "old_logprobs"
REF_LOGPROBS = "ref_logprobs"
OLD_VALUES = "old_values"
ENGINE_LOGPROBS = "engine_logprobs"
SCORES = "scores"
REWARDS = "rewards"
KL = "kl"
POLICY_KL = "policy_kl"
ADVANTAGES = "advantages"
RETURNS = "returns"
POLICY_VERSION = "policy_version"
ACTION_MASK = "action_mask"
TURN_REWARDS = "turn_rewards"
TURNS = "turns"
TURN = "turn"
ROLE = "role"
TOKEN_START = "token_start"
TOKEN_STOP = "token_stop"
TURN_REWARD = "turn_reward"
DONE = "done"
STOP_REASON = "stop_reason"
ENVIRONMENT_SEED = "environment_seed"
OBSERVATION_SHA256 = "observation_sha256"
DRIFTS = "drifts"

TOKEN_IDS = pa.list_(pa.int32())
CHAT_MESSAGES = pa.list_(
    pa.struct([pa.field("role", pa.string(), nullable=False), pa.field("content", pa.string(), nullable=False)])
)
"""Chat turns ``{role, content}``; an empty list for a plain-text prompt."""
TOKEN_FLOATS = pa.list_(pa.float32())


def _schema(*fields: tuple[str, pa.DataType], nullable: tuple[str, ...] = ()) -> pa.Schema:
    return pa.schema([pa.field(name, dtype, nullable=name in nullable) for name, dtype in fields])


#: Prompts to sample from (stage 1 input). ``prompt`` is the text of a plain prompt, or a readable
#: rendering of a chat prompt's ``messages`` (for judges, forms and logs; the models see the turns
#: through their tokenizer's chat template).
PROMPTS = _schema((PROMPT_ID, pa.int64()), (PROMPT, pa.string()), (MESSAGES, CHAT_MESSAGES))

#: Candidate responses, N per prompt (stage 1 output).
CANDIDATES = _schema(
    (PROMPT_ID, pa.int64()),
    (CANDIDATE_INDEX, pa.int32()),
    (PROMPT, pa.string()),
    (MESSAGES, CHAT_MESSAGES),
    (RESPONSE, pa.string()),
    (PROMPT_IDS, TOKEN_IDS),
    (RESPONSE_IDS, TOKEN_IDS),
    (OLD_LOGPROBS, TOKEN_FLOATS),
    (ENGINE_LOGPROBS, TOKEN_FLOATS),
    nullable=(OLD_LOGPROBS, ENGINE_LOGPROBS),
)
"""``old_logprobs`` (the actor's forward) and ``engine_logprobs`` (the engine's) are null when the project's own
sampler made the candidates (``sampling.engine: hf``): it is the actor's forward."""

#: Preference pairs (stage 2 output); ``margin`` is 0.0 when the labeler gives none. For a chat
#: prompt, ``chosen`` and ``rejected`` are the contents of the final assistant turn.
PREFERENCES = _schema(
    (PAIR_ID, pa.int64()),
    (PROMPT, pa.string()),
    (MESSAGES, CHAT_MESSAGES),
    (CHOSEN, pa.string()),
    (REJECTED, pa.string()),
    (MARGIN, pa.float32()),
    (LABELER, pa.string()),
)

#: Supervised fine-tuning examples (the SFT stage's input, :func:`storage.importers.import_sft_examples`). A row is
#: a conversation (``messages`` with at least one assistant turn; ``prompt`` and ``completion`` empty) or a plain
#: prompt and its completion (``messages`` empty). Empty strings, not nulls (convention 2): no real example has an
#: empty prompt or completion, the importer refuses one.
SFT_EXAMPLES = _schema(
    (EXAMPLE_ID, pa.int64()), (MESSAGES, CHAT_MESSAGES), (PROMPT, pa.string()), (COMPLETION, pa.string())
)

#: A person's answers on the labelling forms (labeler ``human``): ``pair_id`` is the pair's index in
#: the iteration's candidate pairs, ``choice`` one of ``A``, ``B``, ``tie/skip``.
EVALUATION = _schema(
    (PROMPT, pa.string()),
    ("policy_response", pa.string()),
    ("reference_response", pa.string()),
    ("policy_reward", pa.float64()),
    ("reference_reward", pa.float64()),
    (POLICY_KL, pa.float64()),
    (OLD_LOGPROBS, TOKEN_FLOATS),
    (ENGINE_LOGPROBS, TOKEN_FLOATS),
    nullable=("policy_reward", "reference_reward", OLD_LOGPROBS, ENGINE_LOGPROBS),
)
"""One row per held-out prompt: both sides' responses and rewards (null in every row of a campaign without a reward:
a DPO update's), and the policy's KL to the reference (summed over its response), and, when vLLM sampled, the policy's log-probs by the actor's forward and by the engine
(null otherwise; :data:`LOGPROB_COLUMNS`). The pieces evaluation's shards write (its output is ``samples.jsonl``,
without the log-probs)."""

#: The reference's response to each held-out prompt (``row``: the prompt's line in the file), sampled once per
#: campaign and read back by every iteration's evaluation (:mod:`tasks.sample_reference`).
REFERENCE_RESPONSES = _schema((ROW, pa.int64()), (RESPONSE, pa.string()), (RESPONSE_IDS, TOKEN_IDS))

#: The reference's episode from each held-out prompt (``row``: the prompt's line in the file) with an environment,
#: played once per campaign and read back by every iteration's evaluation (:mod:`tasks.episode_evaluation`): the
#: environment's first message (``prompt``), the rest of the conversation as ``role: text`` lines (``response``), the
#: reward of each model turn (``turn_rewards``; the episode's reward is their sum) and its ``stop_reason``.
REFERENCE_EPISODES = _schema(
    (ROW, pa.int64()),
    (PROMPT, pa.string()),
    (RESPONSE, pa.string()),
    (TURN_REWARDS, TOKEN_FLOATS),
    (STOP_REASON, pa.string()),
)

EPISODE_EVALUATION = _schema(
    (PROMPT, pa.string()),
    *((f"{side}_response", pa.string()) for side in ("policy", "reference")),
    *((f"{side}_reward", pa.float64()) for side in ("policy", "reference")),
    *((f"{side}_{TURN_REWARDS}", TOKEN_FLOATS) for side in ("policy", "reference")),
    *((f"{side}_{STOP_REASON}", pa.string()) for side in ("policy", "reference")),
    (POLICY_KL, pa.float64()),
    (OLD_LOGPROBS, TOKEN_FLOATS),
    (ENGINE_LOGPROBS, TOKEN_FLOATS),
    nullable=(OLD_LOGPROBS, ENGINE_LOGPROBS),
)
"""One row per held-out episode with an environment: each side's conversation after the environment's first message
(``prompt``, the policy's; the reference's is played from the same seed), its reward (the sum of its turn rewards),
the reward of each of its model turns and its stop reason, the policy's KL to the reference (summed over its model
tokens), and, when vLLM sampled, the policy's log-probs of its model tokens by the actor's forward and by the engine
(null otherwise; :data:`LOGPROB_COLUMNS`). The pieces evaluation's shards write (its output is ``samples.jsonl``,
without the log-probs)."""

#: The reference's log-probs of each preference pair a DPO update trains on (:mod:`tasks.reference_logprobs`), beside
#: the pair's tokens in the policy's ids, so the update and every replay of it read them back instead of running the
#: reference: ``prompt_ids`` unpadded, ``chosen_ids`` / ``rejected_ids`` each response's action tokens (through its
#: end of turn); per response the summed log-prob, its token count and the mean per token (what IPO and SimPO read).
REFERENCE_LOGPROBS = _schema(
    (PAIR_ID, pa.int64()),
    (PROMPT_IDS, TOKEN_IDS),
    (CHOSEN_IDS, TOKEN_IDS),
    (REJECTED_IDS, TOKEN_IDS),
    *((f"{REF_LOGPROBS}_{side}", pa.float32()) for side in (CHOSEN, REJECTED)),
    *((f"{REF_LOGPROBS}_{side}_mean", pa.float32()) for side in (CHOSEN, REJECTED)),
    *((f"{side}_tokens", pa.int32()) for side in (CHOSEN, REJECTED)),
)

#: The values of the critic a PPO update starts from for a rollout's rows, where an older policy's critic scored them
#: (``sampling.staleness``; :mod:`tasks.critic_values`): ``row`` the experience's row, ``old_values`` laid out as the
#: experience's (one value per ``response_ids`` token, 0 at an episode's environment tokens); stage 5 reads them in
#: place of the experience's (:func:`storage.experience_io.with_values`).
CRITIC_VALUES = _schema((ROW, pa.int64()), (OLD_VALUES, TOKEN_FLOATS))

PAIR_MEASURES = _schema(
    (PAIR_ID, pa.int64()),
    *((f"logps_{side}", pa.float32()) for side in (CHOSEN, REJECTED)),
    *((f"rewards_{side}", pa.float32()) for side in (CHOSEN, REJECTED)),
)
"""A DPO update's pairs as its policy sees them after it (:class:`rlhf_core.dpo.PairMeasures`): the log-prob (sum) of
each response, and its implicit reward; by ``pair_id``, beside the ``reference_logprobs`` rows it trained on."""

LOGPROB_COLUMNS = (OLD_LOGPROBS, ENGINE_LOGPROBS)
"""The trainer's and the engine's log-probs of sampled tokens, whose mismatch a generation stage records."""

SAMPLES = "samples.jsonl"
"""A stage output's sample rows as JSON lines (evaluation: the :data:`EVALUATION` columns plus ``policy_gold`` and
``reference_gold`` where a gold judge scored them), also logged as an MLflow table, so the UI shows what the policy
writes beside what the reward model and the gold judge made of it."""

HUMAN_LABELS = _schema((PAIR_ID, pa.int64()), (CHOICE, pa.string()))

#: Per-token fields of an unscored Experience, in schema order.
EXPERIENCE_TOKEN_COLUMNS = (OLD_LOGPROBS, REF_LOGPROBS, OLD_VALUES, ENGINE_LOGPROBS)
#: Per-token fields that are null in every row, or in none: ``old_values`` without a critic, ``engine_logprobs``
#: in experience written by code that kept none.
NULLABLE_TOKEN_COLUMNS = (OLD_VALUES, ENGINE_LOGPROBS)
#: Per-token fields that stage 5 adds, in schema order.
SCORED_TOKEN_COLUMNS = (REWARDS, KL, ADVANTAGES, RETURNS)

#: Rollout experience (stage 4 output). ``prompt_id`` is the prompt's id in its file (the rows of one
#: prompt form a group), ``prompt_ids`` the unpadded prompt tokens, ``response_ids`` the unpadded
#: action tokens; ``old_values`` is null throughout when the rollout had no critic; ``engine_logprobs`` are the
#: sampler's log-probs of the actions (``old_logprobs`` are the trainer's); ``policy_version`` the version of the
#: policy that sampled the row (the updates behind it), null only in experience of schema 5, read as it was.
EXPERIENCE = _schema(
    (ROW, pa.int64()),
    (PROMPT_ID, pa.int64()),
    (PROMPT_IDS, TOKEN_IDS),
    (RESPONSE_IDS, TOKEN_IDS),
    *((name, TOKEN_FLOATS) for name in EXPERIENCE_TOKEN_COLUMNS),
    (SCORES, pa.float32()),
    (POLICY_VERSION, pa.int64()),
    (ACTION_MASK, pa.list_(pa.bool_())),
    (TURN_REWARDS, TOKEN_FLOATS),
    nullable=(*NULLABLE_TOKEN_COLUMNS, POLICY_VERSION, ACTION_MASK, TURN_REWARDS),
)
"""Of a multi-turn episode (schema 7), ``response_ids`` is the whole response window, the model's turns and the
environment's replies between them, every per-token list as long; ``action_mask`` is True at the model's tokens (the
loss mask: all False for an episode whose environment failed, which stays out of the loss), ``turn_rewards`` the reward
of each of its model turns, and ``scores`` their sum. Both are null in single-turn experience (every response token an
action; no turns)."""

#: The turns of a rollout of episodes (its second table, beside ``experience``): one row per segment of each episode's
#: response window, in order: a model turn (``role`` assistant) or the environment's reply after it (``role`` user),
#: both numbered ``turn`` by the model turn. ``token_start``/``token_stop`` are the segment's range in the response
#: window (``response_ids[start:stop]``); the segments of an episode cover it exactly. ``turn_reward`` is the model
#: turn's reward (null on the environment's rows); ``done`` whether the episode ended with that segment;
#: ``stop_reason`` why, on its last segment (``done``, ``max_turns``, ``timeout``, ``error: <Type>: <message>``; null
#: elsewhere); ``environment_seed`` the seed its environment was reset with; ``observation_sha256`` the sha256 of the
#: environment's message on its rows (null on the model's, and where the environment answered with none), so a replay
#: or a resumed rollout can tell the same reply from another; ``row`` the episode's experience row.
TURNS_TABLE = _schema(
    (ROW, pa.int64()),
    (PROMPT_ID, pa.int64()),
    (TURN, pa.int32()),
    (ROLE, pa.string()),
    (TOKEN_START, pa.int32()),
    (TOKEN_STOP, pa.int32()),
    (TURN_REWARD, pa.float32()),
    (DONE, pa.bool_()),
    (STOP_REASON, pa.string()),
    (ENVIRONMENT_SEED, pa.int64()),
    (OBSERVATION_SHA256, pa.string()),
    (POLICY_VERSION, pa.int64()),
    nullable=(TURN_REWARD, STOP_REASON, OBSERVATION_SHA256),
)

#: A shard's piece of a rollout of episodes: its experience rows, each with its segments (the :data:`TURNS_TABLE`
#: columns that are not the row's own) and whether a full re-render of its conversation tokenizes otherwise
#: (``drifts``, counted in a metric), split into the two tables when the stage writes them.
SEGMENT = pa.struct([pa.field(field.name, field.type, nullable=field.nullable) for field in TURNS_TABLE][2:-1])
EPISODES = pa.schema(
    [*EXPERIENCE, pa.field(TURNS, pa.list_(SEGMENT), nullable=False), pa.field(DRIFTS, pa.bool_(), nullable=False)]
)

#: Experience plus shaped rewards, KL, advantages and returns (stage 5 output).
SCORED_EXPERIENCE = pa.schema(
    [*EXPERIENCE, *(pa.field(name, TOKEN_FLOATS, nullable=False) for name in SCORED_TOKEN_COLUMNS)]
)

#: Every schema by table name, e.g. for tools that inspect a stage folder.
SCHEMAS: dict[str, pa.Schema] = {
    "prompts": PROMPTS,
    "candidates": CANDIDATES,
    "preferences": PREFERENCES,
    "sft_examples": SFT_EXAMPLES,
    "human_labels": HUMAN_LABELS,
    "experience": EXPERIENCE,
    "scored_experience": SCORED_EXPERIENCE,
    "turns": TURNS_TABLE,
    "reference_responses": REFERENCE_RESPONSES,
    "reference_episodes": REFERENCE_EPISODES,
    "reference_logprobs": REFERENCE_LOGPROBS,
    "critic_values": CRITIC_VALUES,
    "pair_measures": PAIR_MEASURES,
}


def _kind(dtype: pa.DataType) -> str:
    """A coarse type family; casts are allowed only within a family (and from int to float)."""
    if pa.types.is_null(dtype):
        return "null"
    if pa.types.is_integer(dtype):
        return "int"
    if pa.types.is_floating(dtype):
        return "float"
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype):
        return "string"
    if pa.types.is_boolean(dtype):
        return "bool"
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype):
        return f"list<{_kind(dtype.value_type)}>"
    if pa.types.is_struct(dtype):
        return "struct<" + ",".join(f"{field.name}:{_kind(field.type)}" for field in dtype) + ">"
    return str(dtype)


def _castable(source: pa.DataType, target: pa.DataType) -> bool:
    have, want = _kind(source), _kind(target)
    if have == want or have == "null":
        return True
    # Ints widen to floats (a JSON margin of 1 is 1.0); nothing else changes family silently.
    return want.replace("float", "int") == have and "float" in want


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Check ``table`` against ``schema`` and return it cast to exactly that schema, in schema order.

    Casts are safe (an int64 token id that does not fit int32 is an error) and stay within a type
    family: ints to ints or floats, floats to floats, strings to strings, lists to lists of the
    same. A string column is never parsed into numbers.

    Args:
        table: any Arrow table.
        schema: the target schema.

    Returns:
        The table with ``schema`` as its schema, one chunk per column kept as it was.

    Raises:
        ValueError: a column is missing, extra, of an incompatible type, holds values that do not
            fit, or holds nulls (at the top level or inside a list); the message names the column.
    """
    names = set(table.column_names)
    missing = [field.name for field in schema if field.name not in names]
    extra = [name for name in table.column_names if schema.get_field_index(name) < 0]
    if missing or extra:
        raise ValueError(f"table does not match the schema: missing columns {missing}, unexpected columns {extra}")
    if len(names) != len(table.column_names):
        raise ValueError(f"table has duplicate column names: {table.column_names}")
    columns = []
    for field in schema:
        column = table.column(field.name)
        if not _castable(column.type, field.type):
            raise ValueError(f"column `{field.name}` has type {column.type}, expected {field.type}")
        if column.type != field.type:
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise ValueError(f"column `{field.name}` cannot be cast to {field.type}: {error}") from error
        if not field.nullable and column.null_count:
            raise ValueError(f"column `{field.name}` has {column.null_count} null values; it must have none")
        if pa.types.is_list(field.type) and len(column) and pc.list_flatten(column).null_count:
            raise ValueError(f"column `{field.name}` has null values inside its lists")
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


TABLES = {
    "candidates": CANDIDATES,
    "preferences": PREFERENCES,
    "experience": EXPERIENCE,
    "episodes": EPISODES,
    "evaluation": EVALUATION,
    "episode_evaluation": EPISODE_EVALUATION,
    "reference_responses": REFERENCE_RESPONSES,
    "reference_episodes": REFERENCE_EPISODES,
}
"""The tables a fan-out stage's shards write, by name (a shard's rows travel to the stage as a named table)."""
