"""The distributed layer: directory actors, builder tasks and the rebuild driver (Ray)."""
