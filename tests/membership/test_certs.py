"""Cluster CA and node certificates: files, key modes, SAN URIs, signatures and refusals."""

from __future__ import annotations

import datetime
import re
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from membership import ConfigurationError
from membership._certs import (
    CA_CERT,
    CA_KEY,
    CaFiles,
    create_cluster_ca,
    create_node_certificate,
    load_cluster_ca,
)

INVALID_NAMES = ["", "two words", "a/b", "x" * 64, "-leading-dash"]


@pytest.fixture
def ca(tmp_path: Path) -> CaFiles:
    return create_cluster_ca("shop", tmp_path / "ca")


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def san_uris(cert: x509.Certificate) -> list[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return san.get_values_for_type(x509.UniformResourceIdentifier)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_foreign_ca(ca_dir: Path, common_name: str) -> None:
    """A CA not made by ``create_cluster_ca``: only a common name in its subject."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    ca_dir.mkdir()
    (ca_dir / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (ca_dir / CA_KEY).write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def test_the_ca_files_are_written_with_a_private_key_mode_0600(ca: CaFiles) -> None:
    assert (ca.cert_file.name, ca.key_file.name) == (CA_CERT, CA_KEY)
    assert mode(ca.key_file) == 0o600
    cert = load(ca.cert_file)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(cert)


def test_load_cluster_ca_reads_back_the_cluster_name(ca: CaFiles) -> None:
    cert, _key, cluster = load_cluster_ca(ca.cert_file.parent)
    assert cluster == "shop"
    assert cert == load(ca.cert_file)


def test_a_node_certificate_names_its_node_and_is_signed_by_the_ca(
    ca: CaFiles, tmp_path: Path
) -> None:
    files = create_node_certificate("node-1", ca.cert_file.parent, tmp_path / "node-1")
    assert (files.cluster, files.node) == ("shop", "node-1")
    assert mode(files.key_file) == 0o600
    cert = load(files.cert_file)
    assert san_uris(cert) == ["p2pshard://shop/node-1"]
    cert.verify_directly_issued_by(load(ca.cert_file))
    assert files.ca_file.read_bytes() == ca.cert_file.read_bytes()


def test_the_cluster_name_can_be_overridden(ca: CaFiles, tmp_path: Path) -> None:
    files = create_node_certificate("n", ca.cert_file.parent, tmp_path / "n", cluster="other")
    assert files.cluster == "other"
    assert san_uris(load(files.cert_file)) == ["p2pshard://other/n"]


def test_an_existing_ca_key_is_not_overwritten_without_force(ca: CaFiles) -> None:
    key = ca.key_file.read_bytes()
    with pytest.raises(
        ConfigurationError, match=re.escape(f"{ca.key_file} already exists; refusing")
    ):
        create_cluster_ca("shop", ca.cert_file.parent)
    assert ca.key_file.read_bytes() == key


def test_an_existing_node_key_is_not_overwritten_without_force(ca: CaFiles, tmp_path: Path) -> None:
    files = create_node_certificate("n", ca.cert_file.parent, tmp_path / "n")
    key = files.key_file.read_bytes()
    with pytest.raises(ConfigurationError, match="already exists; refusing to overwrite"):
        create_node_certificate("n", ca.cert_file.parent, tmp_path / "n")
    assert files.key_file.read_bytes() == key


def test_force_replaces_the_keys_and_keeps_mode_0600(ca: CaFiles, tmp_path: Path) -> None:
    old_ca_key = ca.key_file.read_bytes()
    ca.key_file.chmod(0o644)
    create_cluster_ca("shop", ca.cert_file.parent, force=True)
    assert ca.key_file.read_bytes() != old_ca_key
    assert mode(ca.key_file) == 0o600

    files = create_node_certificate("n", ca.cert_file.parent, tmp_path / "n")
    old_node_key = files.key_file.read_bytes()
    create_node_certificate("n", ca.cert_file.parent, tmp_path / "n", force=True)
    assert files.key_file.read_bytes() != old_node_key
    assert mode(files.key_file) == 0o600
    load(files.cert_file).verify_directly_issued_by(load(ca.cert_file))


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
def test_an_invalid_cluster_name_is_refused_naming_it(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=f"cluster name {name!r} is invalid"):
        create_cluster_ca(name, tmp_path / "ca")
    assert not (tmp_path / "ca").exists()


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
def test_an_invalid_node_name_is_refused_naming_it(name: str, ca: CaFiles, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=f"node name {name!r} is invalid"):
        create_node_certificate(name, ca.cert_file.parent, tmp_path / "n")


@pytest.mark.parametrize("name", INVALID_NAMES, ids=repr)
def test_an_invalid_cluster_override_is_refused_naming_it(
    name: str, ca: CaFiles, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match=f"cluster name {name!r} is invalid"):
        create_node_certificate("n", ca.cert_file.parent, tmp_path / "n", cluster=name)


def test_63_character_names_are_accepted(tmp_path: Path) -> None:
    long = "c" * 63
    assert create_cluster_ca(long, tmp_path / "ca").cluster == long
    files = create_node_certificate("n" * 63, tmp_path / "ca", tmp_path / "n")
    assert san_uris(load(files.cert_file)) == [f"p2pshard://{long}/{'n' * 63}"]


def test_a_ca_named_in_its_common_name_still_gives_its_cluster(tmp_path: Path) -> None:
    write_foreign_ca(tmp_path / "ca", "p2pshard cluster CA shop")  # the CN-only format
    assert load_cluster_ca(tmp_path / "ca")[2] == "shop"
    assert create_node_certificate("n", tmp_path / "ca", tmp_path / "n").cluster == "shop"


def test_a_foreign_ca_needs_the_cluster_name_passed(tmp_path: Path) -> None:
    write_foreign_ca(tmp_path / "ca", "Acme Root CA")
    with pytest.raises(ConfigurationError, match="does not name a cluster"):
        create_node_certificate("n", tmp_path / "ca", tmp_path / "n")
    files = create_node_certificate("n", tmp_path / "ca", tmp_path / "n", cluster="shop")
    load(files.cert_file).verify_directly_issued_by(load(tmp_path / "ca" / CA_CERT))


def test_a_missing_ca_dir_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"cannot read the cluster CA in .*nowhere"):
        create_node_certificate("n", tmp_path / "nowhere", tmp_path / "n")
    assert not (tmp_path / "n").exists()


def test_a_ca_dir_with_garbage_files_is_a_configuration_error(ca: CaFiles, tmp_path: Path) -> None:
    ca.cert_file.write_bytes(b"not a certificate")
    with pytest.raises(ConfigurationError, match="cannot read the cluster CA"):
        create_node_certificate("n", ca.cert_file.parent, tmp_path / "n")


def test_days_below_one_are_refused(ca: CaFiles, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="days = 0 is invalid"):
        create_cluster_ca("shop", tmp_path / "ca2", days=0)
    with pytest.raises(ConfigurationError, match="days = 0 is invalid"):
        create_node_certificate("n", ca.cert_file.parent, tmp_path / "n", days=0)
