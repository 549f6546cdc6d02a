"""Checkpoints and snapshots: the files, the directory's lock, the manager the session holds, the pause
orders of asynchronous snapshots, and the disks they go to."""
