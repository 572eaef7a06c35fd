"""The committed generated modules match the .proto, and the .proto matches the reference."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb

REPO = Path(__file__).resolve().parents[2]


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_are_fresh():
    pytest.importorskip("grpc_tools")
    from importlib.metadata import version

    committed = (REPO / "torchheal" / "_wire" / "torchft_pb2_grpc.py").read_text()
    match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", committed)
    assert match, "committed torchft_pb2_grpc.py has no GRPC_GENERATED_VERSION"
    if version("grpcio-tools") != match.group(1):
        pytest.skip(
            f"grpcio-tools {version('grpcio-tools')} differs from {match.group(1)} that made "
            "the committed modules; output would differ for that reason alone"
        )
    gen_proto = _load_gen_proto()
    assert gen_proto.stale_files() == [], "run python scripts/gen_proto.py"


def test_check_mode_detects_a_stale_module(tmp_path):
    pytest.importorskip("grpc_tools")
    gen_proto = _load_gen_proto()
    wire = REPO / "torchheal" / "_wire"
    for name in gen_proto.GENERATED:
        (tmp_path / name).write_bytes((wire / name).read_bytes())
    (tmp_path / "torchft_pb2.py").write_text("# edited by hand\n")
    assert gen_proto.stale_files(tmp_path) == ["torchft_pb2.py"]


# Field numbers of the reference protocol (§3.1); changing one breaks interoperability.
EXPECTED_FIELDS = {
    "QuorumMember": {
        "replica_id": 1,
        "address": 2,
        "store_address": 3,
        "step": 4,
        "world_size": 5,
        "shrink_only": 6,
        "data": 7,
        "commit_failures": 8,
    },
    "Quorum": {"quorum_id": 1, "participants": 2, "created": 3},
    "LighthouseQuorumRequest": {"requester": 1},
    "LighthouseQuorumResponse": {"quorum": 1},
    "LighthouseHeartbeatRequest": {"replica_id": 1},
    "LighthouseHeartbeatResponse": {},
    "ManagerQuorumRequest": {
        "group_rank": 1,
        "step": 2,
        "checkpoint_metadata": 3,
        "shrink_only": 4,
        "init_sync": 5,
        "commit_failures": 6,
        "data": 1001,  # torchheal only: group rank 0's guard report
    },
    "ManagerQuorumResponse": {
        "quorum_id": 1,
        "recover_src_manager_address": 2,
        "recover_src_replica_rank": 3,
        "recover_dst_replica_ranks": 4,
        "store_address": 5,
        "max_step": 6,
        "max_replica_rank": 7,
        "max_world_size": 8,
        "replica_rank": 9,
        "replica_world_size": 10,
        "heal": 11,
        "commit_failures": 12,
        "replica_ids": 13,  # newer reference wheels; tests/compat checks it against one
    },
    "CheckpointMetadataRequest": {"rank": 1},
    "CheckpointMetadataResponse": {"checkpoint_metadata": 1},
    "ShouldCommitRequest": {"should_commit": 1, "group_rank": 2, "step": 3, "salvageable": 1001},
    "ShouldCommitResponse": {"should_commit": 1, "redo": 1001},
    "KillRequest": {"msg": 1},
    "KillResponse": {},
    "RaftMessageRequest": {"message": 1},
    "NodeInfo": {"rank": 1, "address": 2},
    "InfoRequest": {"requester": 1},
    "InfoResponse": {"peers": 1},
}


#: torchheal's own fields in the reference's messages (salvage_step's group vote, the group's
#: data from rank 0). The reference never sets them and skips them as unknown; numbered far
#: above its own, so a field it adds later cannot take the same number.
TORCHHEAL_ONLY = {
    "ShouldCommitRequest": {"salvageable"},
    "ShouldCommitResponse": {"redo"},
    "ManagerQuorumRequest": {"data"},
}


def test_torchheal_only_fields_stay_clear_of_the_reference_numbers():
    for message, names in TORCHHEAL_ONLY.items():
        for name in names:
            assert EXPECTED_FIELDS[message][name] > 1000, (message, name)


def test_a_reference_reader_skips_the_torchheal_only_fields():
    # The reference's ShouldCommitResponse has field 1 only: a decoder built from that message
    # alone must read the bytes torchheal sends, the extension skipped as an unknown field.
    sent = pb.ShouldCommitResponse(should_commit=True, redo=True).SerializeToString()
    proto = descriptor_pb2.FileDescriptorProto(name="ref_vote.proto", package="ref")
    msg = proto.message_type.add(name="ShouldCommitResponse")
    msg.field.add(name="should_commit", number=1, type=8, label=1)  # bool, optional
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    reference = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("ref.ShouldCommitResponse")
    )
    assert reference.FromString(sent).should_commit is True


@pytest.mark.parametrize("message", sorted(EXPECTED_FIELDS))
def test_field_numbers_match_reference(message):
    descriptor = pb.DESCRIPTOR.message_types_by_name[message]
    assert {f.name: f.number for f in descriptor.fields} == EXPECTED_FIELDS[message]


def test_optional_fields_track_presence():
    response = pb.ManagerQuorumResponse()
    assert not response.HasField("recover_src_replica_rank")
    response.recover_src_replica_rank = 0
    assert response.HasField("recover_src_replica_rank")
    assert not response.HasField("max_replica_rank")


def test_services_and_method_table():
    assert pb.DESCRIPTOR.package == "torchft"
    services = {s.name: s for s in pb.DESCRIPTOR.services_by_name.values()}
    assert set(services) == {"LighthouseService", "ManagerService", "CoordinatorService"}
    assert [m.name for m in services["LighthouseService"].methods] == ["Quorum", "Heartbeat"]
    assert [m.name for m in services["ManagerService"].methods] == [
        "Quorum",
        "CheckpointMetadata",
        "ShouldCommit",
        "Kill",
    ]
    table = [
        methods.LIGHTHOUSE_QUORUM,
        methods.LIGHTHOUSE_HEARTBEAT,
        methods.MANAGER_QUORUM,
        methods.MANAGER_CHECKPOINT_METADATA,
        methods.MANAGER_SHOULD_COMMIT,
        methods.MANAGER_KILL,
    ]
    for method in table:
        service = services[method.service.removeprefix("torchft.")]
        descriptor = service.methods_by_name[method.name]
        assert descriptor.input_type.full_name == method.request.DESCRIPTOR.full_name
        assert descriptor.output_type.full_name == method.response.DESCRIPTOR.full_name
    assert methods.MANAGER_SHOULD_COMMIT.path == "/torchft.ManagerService/ShouldCommit"


def test_generated_grpc_module_imports():
    from torchheal._wire import torchft_pb2_grpc

    assert hasattr(torchft_pb2_grpc, "LighthouseServiceStub")
    assert hasattr(torchft_pb2_grpc, "add_ManagerServiceServicer_to_server")
