"""The wire protocol: ``torchft.proto`` and the modules protoc generated from it.

``torchft_pb2`` holds the message classes; ``torchft_pb2_grpc`` the generated stubs and
servicers (kept for users and tools). torchheal's own servers and clients register their
methods from the table in :mod:`torchheal._wire.methods` instead, for two reasons: only
``protobuf`` is then version-coupled to the generated code (the generated grpc module refuses
to import under a grpcio older than the grpcio-tools that made it), and servers receive raw
bytes so that a request that does not parse gets ``INVALID_ARGUMENT`` rather than a generic
``INTERNAL``. Regenerate with ``python scripts/gen_proto.py``.
"""
