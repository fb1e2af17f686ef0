import pytest

from cluster.auth import AdminAuth, AuthError


def _status(auth: AdminAuth, header: str | None) -> int:
    with pytest.raises(AuthError) as e:
        auth.check(header)
    return e.value.status_code


def test_right_token_passes():
    AdminAuth("T", "s3cret").check("Bearer s3cret")
    AdminAuth("T", "s3cret").check("bearer  s3cret ")


def test_missing_or_malformed_header_is_401():
    auth = AdminAuth("T", "s3cret")
    assert _status(auth, None) == 401
    assert _status(auth, "") == 401
    assert _status(auth, "Basic s3cret") == 401
    assert _status(auth, "Bearer ") == 401


def test_wrong_token_is_403():
    assert _status(AdminAuth("T", "s3cret"), "Bearer nope") == 403
    assert _status(AdminAuth("T", "s3cret"), "Bearer s3cret2") == 403


def test_no_token_configured_refuses_everything(monkeypatch):
    monkeypatch.delenv("LORA_TEST_ADMIN_TOKEN", raising=False)
    auth = AdminAuth.from_env("LORA_TEST_ADMIN_TOKEN")
    assert auth.token is None
    with pytest.raises(AuthError, match="LORA_TEST_ADMIN_TOKEN") as e:
        auth.check("Bearer anything")
    assert e.value.status_code == 403


def test_from_env_reads_token(monkeypatch):
    monkeypatch.setenv("LORA_TEST_ADMIN_TOKEN", "abc")
    AdminAuth.from_env("LORA_TEST_ADMIN_TOKEN").check("Bearer abc")
