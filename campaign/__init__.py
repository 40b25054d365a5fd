"""The campaign model: what identifies a campaign and its runs, its history and what may be removed.

Imports neither Prefect nor torch, so a command that only reads a campaign (a finished ``rlhf run``,
``rlhf gc``, the reports) starts in seconds. ``flows`` runs the flows and the CLI on top of it.

* :mod:`campaign.settings`: what each stage receives, and the settings that reach no key (derived, not listed).
* :mod:`campaign.identity`: base inputs (located, hashed), run keys and the campaign's config fingerprint.
* :mod:`campaign.store`: where a campaign's outputs and MLflow store are, and run names (``demo:3``).
* :mod:`campaign.history`: the finished iterations, what produced them, what differs now.
* :mod:`campaign.gc`: what ``rlhf gc`` keeps and removes.
"""
