"""The manager server: one per replica group, run by its group rank 0.

``server`` (``ManagerServer``) with ``in_process`` (rank 0's calls), ``quorum_request``,
``vote``, ``notices``, and its lighthouse link: ``link``, ``link_session``, ``link_unary``,
``link_standing``, ``link_tcp`` (the direct lane) and ``dial`` (reaching a lighthouse).
"""
