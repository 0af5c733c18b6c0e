"""Primitives every other room stands on: errors, op descriptions, deadlines, the flight
recorder and the event-loop seam. Imports nothing else of asynccoll."""
