"""Attacks played against the real components: each test asserts the attack fails and the service stays up."""
