"""Prefect flows: the iteration and campaign flows, their config, and the ``rlhf`` command line."""
