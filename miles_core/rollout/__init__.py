"""Rollout, the driver's side of generation: the router that spreads requests over engines and the
engine group that starts them, the manager that turns prompts into scored groups, custom generate
functions (context, multi-turn, self-correction), remote rewards and partial rollouts across weight
updates. It runs in the driver process; the engines themselves are in miles_core.engines.
"""
