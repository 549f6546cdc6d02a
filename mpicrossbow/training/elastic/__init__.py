"""Elastic training, the training side: steps committed on every survivor or on none, snapshots met over the
survivors, whether a run is elastic, and replacement ranks."""
