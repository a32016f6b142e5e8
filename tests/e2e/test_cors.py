"""CORS: configured browser origins may call the API (preflights answered without the key, which
browsers never send on them); other origins get no CORS headers; the key is still required.
On conftest's strict server (the one test_limits.py uses), which has CORS for two origins."""

from __future__ import annotations

import httpx
import pytest
from conftest import CORS_ORIGIN as ORIGIN
from conftest import STRICT_KEY as KEY


@pytest.fixture
def server(strict_server):
    return strict_server


def test_a_configured_origin_gets_its_preflight_and_its_headers(server):
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    models = httpx.get(
        server.url + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}
    )
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == ORIGIN


def test_other_origins_get_no_cors_headers_and_the_key_is_still_needed(server):
    other = httpx.get(
        server.url + "/v1/models",
        headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"},
    )
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    denied = httpx.options(
        server.url + "/v1/models",
        headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"},
    )
    assert denied.status_code == 400 and "access-control-allow-origin" not in denied.headers
    keyless = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert keyless.status_code == 401


def test_a_bad_origin_is_refused_at_start(capsys):
    from noesis import cli

    code = cli.main(["serve", "--model", "/nonexistent", "--cors-origins", "localhost:3000"])
    assert code != 0 and "'localhost:3000' is not an origin" in capsys.readouterr().err
