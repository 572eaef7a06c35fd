"""The local fault-tolerance demo: a launcher-driven job of small replica groups.

`worker.py` is one replica group's training process (it reports progress through
``torchheal.launcher.events``); `run.py` drives a whole run; `summary.py` turns the events of
a run into the closing summary.
"""
