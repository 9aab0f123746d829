"""Scoring: reward functions, a group's weighted rewards, the failure guard, and the reward service (a role of its own, `tandem reward`: service, model) with the generator's client of it."""
