"""The chaos run of issue 25: the nightly flow on the PostgreSQL team stack, killed at random."""
