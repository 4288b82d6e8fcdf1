"""Rollout: per-cell inference engine, sampler and model-call proxy.

Import the parts directly (kept light so ``gyre.rollout.types`` does not pull in jax):
``gyre.rollout.engine.Engine``, ``gyre.rollout.proxy.Proxy``, ``gyre.rollout.sampler``,
``gyre.rollout.types.GenerateRequest`` / ``GenerateResponse``.
"""
