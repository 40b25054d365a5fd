"""Adapters that run the environments of existing ecosystems through this pipeline's environment contract
(:mod:`runtime.environments`, docs/environments.md): name one as ``environment.class``. Each imports its ecosystem
only when an episode starts, so the ecosystem is an optional extra (``pip install 'rlhf-pipeline[textarena]'``)."""
