"""Findings to intents: one poll's decisions, ladders, reset gates, outcomes, the plan state."""
