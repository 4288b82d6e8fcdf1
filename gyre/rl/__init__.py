"""The RL runtime: the builder (config -> specs -> parts), the controller that schedules rollout
and training over the cells, step work and metrics, evaluation, progress files, and the
supervised warm start with its expert demonstrations.

Entry points are in :mod:`gyre.rl.experiment`; the offline scheduler library (policies,
simulator) is :mod:`gyre.elastic`.
"""
