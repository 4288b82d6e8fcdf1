"""Offline scheduler library: allocation policies (pure functions of a load snapshot), the
simulator, its cost model and calibration, and synthetic or recorded workloads."""
