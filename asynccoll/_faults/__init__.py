"""Fault handling: liveness (heartbeats, census, abort news) and shrinking to the survivors."""
