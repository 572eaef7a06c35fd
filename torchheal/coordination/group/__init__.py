"""The manager server: one per replica group, run by its group rank 0.

``server`` (``ManagerServer``, its gRPC shell), with ``in_process`` (group rank 0's calls
without gRPC), ``quorum_request`` (the group's lighthouse request and its retries), ``vote``
(the group's commit vote), ``notices`` (passing ``MemberLost`` notices to its ranks), and its
link to the lighthouse: ``link`` (the link's life cycle and requests), ``link_session`` (the
session stream), ``link_unary`` (the reference's unary calls), ``link_standing`` (what the
group saw of its standing), ``dial`` (reaching a lighthouse) and ``link_tcp`` (the direct lane).
"""
