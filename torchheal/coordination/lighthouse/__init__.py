"""The lighthouse: one per job, it decides each quorum (the pure ``coordination.quorum``).

``server`` (``LighthouseServer``, its gRPC shell), ``rounds`` (quorum rounds), ``answers`` (an
issued quorum's bytes), ``session`` and ``tcp`` (its end of a group's session, and the direct
TCP lane), ``notices`` (live sessions and their ``MemberLost`` notices), ``store`` and ``etcd``
(what it keeps across a restart), ``dashboard/`` (its HTTP dashboard).
"""
