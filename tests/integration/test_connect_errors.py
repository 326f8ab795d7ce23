"""A connection that fails says why — a wrong password, a missing vhost, a URL that is not
AMQP, a broker that is not there — on the real broker, through ``mesh status``."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

from mesh.cli import main


def with_url(amqp_url: str, *, password: str | None = None, vhost: str | None = None) -> str:
    parts = urlsplit(amqp_url)
    netloc = parts.netloc
    if password is not None:
        netloc = f"{parts.username}:{password}@{parts.hostname}:{parts.port or 5672}"
    path = parts.path if vhost is None else f"/{vhost}"
    return urlunsplit((parts.scheme, netloc, path, parts.query, ""))


def status_error(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["--amqp-url", url, "status", "--timeout", "2"])
    return code, capsys.readouterr().err


def test_a_wrong_password_says_the_login_was_refused(
    amqp_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = status_error(with_url(amqp_url, password="not-the-password"), capsys)
    assert code == 2
    assert "refused the login" in err and "password" in err
    assert "start it" not in err  # the broker runs: do not send the user to start it


def test_a_missing_vhost_says_so(amqp_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = status_error(with_url(amqp_url, vhost="no-such-vhost"), capsys)
    assert code == 2
    assert "vhost 'no-such-vhost'" in err and "start it" not in err


def test_an_http_url_is_not_blamed_on_the_manager(
    amqp_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = status_error("http://127.0.0.1:15672/", capsys)
    assert code == 2
    assert "not an AMQP URL" in err and "--management-url" in err
    assert "manager" not in err.replace("--management-url", "")


def test_no_broker_at_all_says_to_start_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = status_error("amqp://guest:guest@127.0.0.1:1/", capsys)
    assert code == 2 and "start it" in err
