"""The local fault-tolerance demo: a launcher-driven job of small replica groups.

`worker.py` is one replica group's training process; `events.py` is the line protocol it uses
to report progress; `summary.py` turns the events of a whole run into the closing summary.
"""
