"""The dashboard's HTTP routes against a real lighthouse: status JSON, kill guard, assets."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from tests.dashboard.helpers import Background, get_json, http, lighthouse_with_dashboard
from torchheal.coordination import LighthouseClient
from torchheal.coordination.lighthouse.dashboard.app import STATIC_DIR

TIMEOUT = timedelta(seconds=10)
A = "a:0b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"
B = "b:1b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"


def one_round(port: int, steps: dict[str, int]) -> None:
    """Every replica in ``steps`` asks to join with its step; returns once the quorum is out."""
    clients = {rid: LighthouseClient(f"127.0.0.1:{port}", TIMEOUT) for rid in steps}
    calls = [
        Background(
            lambda rid=rid, c=c, port=9000 + i: c.quorum(
                rid, timeout=TIMEOUT, step=steps[rid], address=f"http://127.0.0.1:{port}"
            )
        )
        for i, (rid, c) in enumerate(clients.items())
    ]
    for call in calls:
        call.join()
    for c in clients.values():
        c.close()


def test_status_document_shows_the_quorum_and_the_charts() -> None:
    with lighthouse_with_dashboard(min_replicas=2) as (lh, _, url):
        empty = get_json(url + "api/status")
        assert empty["quorum"] == {
            "id": 0,
            "age_s": None,
            "size": 0,
            "max_step": None,
            "members": [],
        }
        assert "series" not in empty

        one_round(lh.port(), {A: 3, B: 5})
        doc = get_json(url + "api/status?series_since=0")
        assert doc["version"] == 1
        assert doc["quorum"]["id"] == 1
        assert doc["quorum"]["max_step"] == 5
        members = {m["group"]: m for m in doc["quorum"]["members"]}
        assert members["a"]["replica_id"] == A
        assert members["a"]["healing"] is True and members["a"]["behind"] == 2
        assert members["b"]["healing"] is False
        assert members["a"]["address"] == "http://127.0.0.1:9000"
        assert members["a"]["alive"] is True
        assert doc["job"]["step"] == 5 and doc["job"]["rounds"] == 1
        assert doc["changes"][0]["quorum_id"] == 1
        assert {j["group"] for j in doc["changes"][0]["joined"]} == {"a", "b"}
        assert doc["token_required"] is False
        assert set(doc["series"]) == {"bucket_s", "t", "job", "groups", "quorum_size"}
        assert doc["config"]["min_replicas"] == 2

        status, _, body = http(url + "api/status?series_since=soon")
        assert status == 400 and b"series_since must be a number" in body


def kill_log() -> tuple[list[tuple[str, str]], object]:
    calls: list[tuple[str, str]] = []

    def kill(address: str, message: str) -> None:
        calls.append((address, message))

    return calls, kill


def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    status, _, body = http(url, method="POST", headers=headers)
    return status, json.loads(body)


def test_kill_needs_the_token_when_one_is_set() -> None:
    # The kill RPC itself is exercised end to end by the browser test (it ends a process);
    # here a recording stand-in takes its place so the guard can be checked in-process.
    calls, kill = kill_log()
    with lighthouse_with_dashboard(2, dashboard={"token": "s3cret", "kill": kill}) as (lh, _, url):
        one_round(lh.port(), {A: 1, B: 1})
        target = url + "api/replicas/" + A + "/kill"
        assert get_json(url + "api/status")["token_required"] is True

        status, body = post(target)
        assert status == 401 and "requires the job token" in body["error"]
        status, body = post(target, {"Authorization": "Bearer nope"})
        assert status == 401 and body["error"] == "refused: wrong job token"
        status, body = post(
            target, {"Authorization": "Bearer s3cret", "Origin": "http://elsewhere.example"}
        )
        assert status == 403 and "cross-origin" in body["error"]
        assert calls == []

        status, body = post(url + "api/replicas/zz/kill", {"Authorization": "Bearer s3cret"})
        assert status == 404 and "not in the current quorum" in body["error"]

        status, body = post(target, {"Authorization": "Bearer s3cret"})
        assert status == 200 and body == {
            "ok": True,
            "replica_id": A,
            "message": f"asked {A} to exit",
        }
        assert calls == [("http://127.0.0.1:9000", "killed from dashboard")]

        # The reference's route, and a group's name instead of its replica id, work too.
        status, body = post(url + "replica/b/kill", {"Authorization": "Bearer s3cret"})
        assert status == 200 and body["replica_id"] == B

        # The kills are the cause in the recovery timeline, noticed before the quorum changes.
        failures = get_json(url + "api/status")["failures"]
        assert {(f["group"], f["cause"], f["state"]) for f in failures} == {
            ("a", "killed from dashboard", "noticed"),
            ("b", "killed from dashboard", "noticed"),
        }


def test_kill_is_open_without_a_token_and_reports_an_unreachable_manager() -> None:
    def unreachable(address: str, message: str) -> None:
        raise RuntimeError("failed to connect within timeout of 5s")

    with lighthouse_with_dashboard(dashboard={"kill": unreachable}) as (lh, _, url):
        one_round(lh.port(), {A: 1})
        status, body = post(url + "api/replicas/a/kill")
        assert status == 502
        assert body["error"] == (
            f"could not ask {A} at http://127.0.0.1:9000 to exit: "
            "failed to connect within timeout of 5s"
        )
        assert get_json(url + "api/status")["failures"] == []


def test_page_and_its_assets_are_served_with_a_strict_policy() -> None:
    if not (STATIC_DIR / "vendor" / "uPlot.iife.min.js").is_file():
        pytest.fail(
            "dashboard assets missing: run scripts/setup_env.sh (scripts/dashboard_assets.sh)"
        )
    with lighthouse_with_dashboard() as (_, _, url):
        status, headers, body = http(url)
        assert status == 200 and b"<title>torchheal lighthouse</title>" in body
        assert headers["Content-Security-Policy"].startswith("default-src 'self'")
        for asset in (
            "static/app.js",
            "static/marks.js",
            "static/style.css",
            "static/vendor/uPlot.iife.min.js",
        ):
            assert http(url + asset)[0] == 200, asset
        assert get_json(url + "api/status")["missing_assets"] == []
        assert http(url + "static/..%2Fapp.py")[0] == 404  # dashboard/app.py exists


def test_missing_assets_are_named_not_a_blank_page(tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("index.html", "app.js", "marks.js", "style.css"):
        shutil.copy(STATIC_DIR / name, partial / name)
    with lighthouse_with_dashboard(dashboard={"static_dir": partial}) as (_, _, url):
        doc = get_json(url + "api/status")
        assert doc["missing_assets"] == ["vendor/uPlot.iife.min.js", "vendor/uPlot.min.css"]
        status, _, body = http(url + "static/vendor/uPlot.iife.min.js")
        assert status == 404 and b"scripts/setup_env.sh" in body
    with lighthouse_with_dashboard(dashboard={"static_dir": tmp_path / "none"}) as (_, _, url):
        status, _, body = http(url)
        assert status == 500 and b"scripts/setup_env.sh" in body and b"/metrics" in body
