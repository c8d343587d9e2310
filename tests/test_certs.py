"""`fedpipe certs` and its Python API: a swarm CA, role certificates, the deny list."""
from __future__ import annotations

import datetime as dt
import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from fedpipe.security import certs
from fedpipe.security.certs import CertError, Role
from fedpipe.security.tls import TlsConfig

pytestmark = pytest.mark.timeout(120)
ROOT = pathlib.Path(__file__).resolve().parent.parent


def fedpipe(*args: str) -> subprocess.CompletedProcess:
    # cwd=ROOT so `-m fedpipe` runs this checkout's fedpipe
    return subprocess.run([sys.executable, "-m", "fedpipe", *args], capture_output=True,
                          text=True, timeout=100, cwd=ROOT)


def mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def ago(days: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=days)


@pytest.mark.processes
def test_cli_init_issue_show_revoke_round_trip(tmp_path):
    d = tmp_path / "tls"
    out = fedpipe("certs", "init", "--dir", str(d))
    assert out.returncode == 0, out.stderr
    assert mode(d / "ca.key") == 0o600

    out = fedpipe("certs", "issue", "--dir", str(d), "--role", "node", "--name", "gpu-1",
                  "--host", "10.0.0.5", "--host", "gpu1.example.org", "--days", "30")
    assert out.returncode == 0, out.stderr
    assert mode(d / "gpu-1.key") == 0o600
    ident = certs.read_identity(d / "gpu-1.crt")
    assert (ident.role, ident.name) == (Role.NODE, "gpu-1")

    out = fedpipe("certs", "show", str(d / "gpu-1.crt"))
    assert out.returncode == 0, out.stderr
    fields = dict(line.split(":", 1) for line in out.stdout.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    assert fields["role"] == "node" and fields["name"] == "gpu-1"
    assert fields["serial"] == str(ident.serial)
    cert = certs.load_cert(d / "gpu-1.crt")
    assert fields["not_after"].startswith(f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC")
    assert fields["not_after"].endswith("(valid)")
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc) == dt.timedelta(days=30)
    assert fields["hosts"] == "gpu1.example.org, 10.0.0.5"

    assert certs.load_revoked(d).entries == ()
    out = fedpipe("certs", "revoke", "--dir", str(d), "gpu-1")
    assert out.returncode == 0, out.stderr
    deny = certs.load_revoked(d)
    assert [(e.serial, e.name) for e in deny.entries] == [(ident.serial, "gpu-1")]
    assert deny.is_revoked(ident)
    on_disk = json.loads((d / "revoked.json").read_text())
    assert on_disk["revoked"][0]["serial"] == str(ident.serial)


@pytest.mark.processes
def test_cli_refuses_to_overwrite_a_ca_or_a_certificate(tmp_path):
    d = tmp_path / "tls"
    assert fedpipe("certs", "init", "--dir", str(d)).returncode == 0
    ca_key = (d / "ca.key").read_bytes()
    out = fedpipe("certs", "init", "--dir", str(d))
    assert out.returncode == 1
    assert "ca.crt exists" in out.stderr and "never overwrites" in out.stderr
    assert (d / "ca.key").read_bytes() == ca_key

    assert fedpipe("certs", "issue", "--dir", str(d), "--role", "client", "--name",
                   "alice").returncode == 0
    key = (d / "alice.key").read_bytes()
    out = fedpipe("certs", "issue", "--dir", str(d), "--role", "admin", "--name", "alice")
    assert out.returncode == 1 and "alice.crt exists" in out.stderr
    assert (d / "alice.key").read_bytes() == key
    assert certs.read_identity(d / "alice.crt").role is Role.CLIENT


@pytest.mark.processes
def test_cli_reports_bad_input_in_one_line(tmp_path):
    d = tmp_path / "tls"
    out = fedpipe("certs", "issue", "--dir", str(d), "--role", "node", "--name", "n")
    assert out.returncode == 1 and "no CA in" in out.stderr and "certs init" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert fedpipe("certs", "init", "--dir", str(d)).returncode == 0
    out = fedpipe("certs", "issue", "--dir", str(d), "--role", "client", "--name", "../etc")
    assert out.returncode == 1 and "bad certificate name '../etc'" in out.stderr
    out = fedpipe("certs", "revoke", "--dir", str(d), "nobody")
    assert out.returncode == 1 and "nobody.crt" in out.stderr
    out = fedpipe("certs", "show", str(d / "ca.key"))
    assert out.returncode == 1 and "not a PEM certificate" in out.stderr


def test_issued_certificate_carries_identity_hosts_and_both_key_usages(tmp_path):
    certs.make_ca(tmp_path)
    certs.issue(tmp_path, "tracker", "t")
    certs.issue(tmp_path, "client", "alice")
    t = certs.load_cert(tmp_path / "t.crt")
    san = t.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["fedpipe://tracker/t"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    eku = t.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    ca = certs.load_ca(tmp_path)
    certs.verify_issued_by(t, ca)
    # a client serves nothing, so it names no host by default
    a = certs.load_cert(tmp_path / "alice.crt")
    san = a.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == []
    assert certs.read_identity(a) == certs.Identity(Role.CLIENT, "alice", a.serial_number)


def test_verify_names_another_ca_and_expiry(tmp_path):
    mine, other = tmp_path / "mine", tmp_path / "other"
    certs.make_ca(mine)
    certs.make_ca(other)
    certs.issue(other, "client", "alice")
    certs.issue(mine, "client", "old", not_before=ago(3), days=1)
    certs.issue(mine, "client", "later", not_before=ago(-2), days=5)
    ca = certs.load_ca(mine)
    with pytest.raises(CertError, match="another CA"):
        certs.verify_issued_by(certs.load_cert(other / "alice.crt"), ca)
    with pytest.raises(CertError, match="certificate expired at"):
        certs.verify_issued_by(certs.load_cert(mine / "old.crt"), ca)
    with pytest.raises(CertError, match="not yet valid"):
        certs.verify_issued_by(certs.load_cert(mine / "later.crt"), ca)
    assert certs.describe(mine / "old.crt")["not_after"].endswith("(EXPIRED)")


def test_a_forged_ca_with_the_same_name_is_still_another_ca(tmp_path):
    # same subject, different key: only the signature tells them apart
    mine, forged = tmp_path / "mine", tmp_path / "forged"
    certs.make_ca(mine)
    forged.mkdir()
    real = certs.load_ca(mine)
    key = ec.generate_private_key(ec.SECP256R1())
    fake = (x509.CertificateBuilder().subject_name(real.subject).issuer_name(real.subject)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(ago(1)).not_valid_after(ago(-1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(key, hashes.SHA256()))
    (forged / "ca.crt").write_bytes(fake.public_bytes(serialization.Encoding.PEM))
    (forged / "ca.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    certs.issue(forged, "admin", "mallory")
    with pytest.raises(CertError, match="signature does not verify"):
        certs.verify_issued_by(certs.load_cert(forged / "mallory.crt"), real)


@pytest.mark.parametrize("role,name,hosts,message", [
    ("root", "x", None, "bad role 'root'"),
    ("node", "", None, "bad certificate name ''"),
    ("node", "ca", None, "bad certificate name 'ca'"),
    ("node", "a/b", None, "bad certificate name 'a/b'"),
    ("node", "x" * 65, None, "bad certificate name"),
    ("node", "n", ["bad host!"], "bad host 'bad host!'"),
])
def test_issue_refuses_bad_role_name_or_host(tmp_path, role, name, hosts, message):
    certs.make_ca(tmp_path)
    with pytest.raises(CertError, match=message.replace("(", r"\(")):
        certs.issue(tmp_path, role, name, hosts=hosts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key"]


def test_revoke_is_idempotent_and_a_bad_deny_list_is_an_error(tmp_path):
    certs.make_ca(tmp_path)
    certs.issue(tmp_path, "node", "n1")
    first = certs.revoke(tmp_path, "n1")
    assert certs.revoke(tmp_path, "n1") == first
    assert len(certs.load_revoked(tmp_path).entries) == 1
    (tmp_path / "revoked.json").write_text('{"revoked": [{"serial": "x"}]}')
    with pytest.raises(CertError, match="malformed deny list"):
        certs.load_revoked(tmp_path)
    (tmp_path / "revoked.json").write_text("{")
    with pytest.raises(CertError, match="not JSON"):
        certs.load_revoked(tmp_path)


def test_keys_are_private_even_under_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        certs.make_ca(tmp_path)
        certs.issue(tmp_path, "node", "n1")
    finally:
        os.umask(old)
    assert mode(tmp_path / "ca.key") == mode(tmp_path / "n1.key") == 0o600
    assert mode(tmp_path / "n1.crt") == 0o644


def test_tls_config_checks_the_certificate_at_load(tmp_path):
    certs.make_ca(tmp_path)
    certs.issue(tmp_path, "node", "n1")
    certs.issue(tmp_path, "node", "n2")
    certs.issue(tmp_path, "client", "old", not_before=ago(3), days=1)
    cfg = TlsConfig.load(tmp_path, "n1")
    assert cfg.identity.name == "n1" and cfg.identity.role is Role.NODE
    with pytest.raises(CertError, match="holds 3 certificates"):
        TlsConfig.load(tmp_path)
    with pytest.raises(CertError, match="old.crt: certificate expired"):
        TlsConfig.load(tmp_path, "old")
    assert TlsConfig.load(tmp_path, "old", check=False).identity.name == "old"
    (tmp_path / "n2.key").chmod(0o600)
    (tmp_path / "n2.key").write_bytes((tmp_path / "n1.key").read_bytes())
    with pytest.raises(CertError, match="n2.key is not the key of"):
        TlsConfig.load(tmp_path, "n2")
    with pytest.raises(CertError, match="does not exist"):
        TlsConfig.load(tmp_path / "nowhere", "n1")
    with pytest.raises(CertError, match="nobody.crt is missing"):
        TlsConfig.load(tmp_path, "nobody")


def test_a_tls_directory_under_home_is_given_as_a_shell_would(tmp_path, monkeypatch):
    from fedpipe.security.tls import resolve, tls_dir
    monkeypatch.setenv("HOME", str(tmp_path))
    certs.make_ca(tmp_path / ".fedpipe")
    certs.issue(tmp_path / ".fedpipe", "client", "me")
    assert tls_dir("~/.fedpipe") == tmp_path / ".fedpipe"
    cfg = resolve("~/.fedpipe")
    assert cfg is not None and cfg.identity.name == "me"
    with pytest.raises(CertError, match="TLS directory ~nosuchuser0/x: cannot expand its ~"):
        tls_dir("~nosuchuser0/x")
