"""Overlord against a Redis that requires an ACL user, a password and TLS (rediss://).

A real redis-server (the embedded one) gets an ACL user `overlord` limited to
`overlord:*` keys and no dangerous commands, and its default user switched off; a TLS
front (tls_proxy.py) with a certificate from a test CA sits before it. Only
`rediss://overlord:<password>@...` with that CA gets in.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import redis
from tls_proxy import TlsProxy, issue_certs

from overlord.config import BatchSpec, Job, Mesh, Source, split_redis_password
from overlord.demo.corpus import TEXT_TRANSFORM, generate_corpus
from overlord.errors import ConfigError, StoreError
from overlord.runtime.lease import Lease
from overlord.shm import list_segments, unlink_all
from overlord.sidecar.sidecar import sidecar_running
from overlord.store import EmbeddedRedis, Keys, connect
from overlord.store.client import CA_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV, env_password, redact

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make test certificates"),
]

USER, PASSWORD = "overlord", "s3cret"
ADMIN, ADMIN_PASSWORD = "admin", "adm1n-pw"


class SecuredRedis:
    """The TLS port, the CA that signed it, and an admin client on the server's socket."""

    def __init__(self, port: int, ca: str, admin: redis.Redis, proxy: TlsProxy) -> None:
        self.port, self.ca, self.admin, self.proxy = port, ca, admin, proxy

    def url(self, userinfo: str = f"{USER}:{PASSWORD}@", scheme: str = "rediss") -> str:
        return f"{scheme}://{userinfo}127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    certs = issue_certs(tmp_path_factory.mktemp("tls"))
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    try:
        setup = redis.Redis(unix_socket_path=str(server.socket), socket_timeout=5)
        setup.acl_setuser(ADMIN, enabled=True, passwords=[f"+{ADMIN_PASSWORD}"], keys=["*"], commands=["+@all"])
        # what an operator grants Overlord: its own keys, every command but the dangerous ones
        setup.execute_command("ACL", "SETUSER", USER, "on", f">{PASSWORD}", "~overlord:*", "+@all", "-@dangerous")
        setup.execute_command("ACL", "SETUSER", "default", "off")
        setup.close()
        admin = redis.Redis(
            unix_socket_path=str(server.socket), username=ADMIN, password=ADMIN_PASSWORD, socket_timeout=5
        )
        with TlsProxy(certs, server.socket) as proxy:
            yield SecuredRedis(proxy.port, str(certs.ca), admin, proxy)
        admin.close()
    finally:
        server.stop()


@pytest.fixture
def ca_env(secured, monkeypatch):
    monkeypatch.setenv(CA_ENV, secured.ca)


@pytest.fixture
def no_ca_env(monkeypatch):
    monkeypatch.delenv(CA_ENV, raising=False)


def _overlord_operations(r: redis.Redis, other: redis.Redis, keys: Keys) -> None:
    """The commands Overlord's roles send, each checked by its result."""
    r.set(keys.layout, b'{"streams": 2}', ex=60)
    assert r.get(keys.layout) == b'{"streams": 2}'

    r.hset(keys.nodes, mapping={"n0": b"{}", "n1": b'{"pid": 7}'})
    assert r.hgetall(keys.nodes) == {b"n0": b"{}", b"n1": b'{"pid": 7}'}

    first = r.xadd(keys.plans, {"step": 0})
    r.xadd(keys.plans, {"step": 1})
    [(stream, entries)] = r.xread({keys.plans: first}, count=10, block=100)
    assert stream == keys.plans.encode() and [e[1] for e in entries] == [{b"step": b"1"}]

    with r.pipeline(transaction=True) as pipe:  # MULTI/EXEC
        pipe.hincrby(keys.counters, "truncated", 2).hset(keys.progress, "c0", 3).hget(keys.counters, "truncated")
        assert pipe.execute() == [2, 1, b"2"]

    with r.pipeline() as pipe:  # WATCH: a write by another client between WATCH and EXEC aborts it
        pipe.watch(keys.progress)
        other.hset(keys.progress, "c0", 5)
        pipe.multi()
        pipe.hset(keys.progress, "c0", 4)
        with pytest.raises(redis.WatchError):
            pipe.execute()
    assert r.hget(keys.progress, "c0") == b"5"

    assert r.eval("return redis.call('INCRBY', KEYS[1], ARGV[1])", 1, keys.fence, 41) == 41

    lease = Lease(r, keys, node="n0")  # SET NX PX, INCR, and the renewal script by EVALSHA
    token = lease.acquire(threading.Event())
    assert token == 42 and lease.renew()

    found = set(r.scan_iter(match=f"{keys.base}:*", count=2))
    assert {keys.layout, keys.nodes, keys.plans, keys.counters, keys.progress, keys.leader}.issubset(
        {k.decode() for k in found}
    )


def test_acl_user_over_tls_with_ca_from_env_runs_overlord_commands(secured, ca_env):
    before = len(secured.proxy.tls_versions)
    r = connect(secured.url(), timeout_s=5)
    other = connect(secured.url(), timeout_s=5)
    try:
        _overlord_operations(r, other, Keys("tls-env"))
        assert sum(c["user"] == USER for c in secured.admin.client_list()) >= 2  # both logged in as the ACL user
    finally:
        r.close()
        other.close()
    negotiated = secured.proxy.tls_versions[before:]
    assert len(negotiated) >= 2 and set(negotiated) <= {"TLSv1.2", "TLSv1.3"}


def test_ca_in_url_query_works_without_env(secured, no_ca_env):
    url = f"{secured.url()}?ssl_ca_certs={secured.ca}&ssl_cert_reqs=required"
    r = connect(url, timeout_s=5)
    try:
        r.set(Keys("tls-url").layout, b"x")
        assert r.get(Keys("tls-url").layout) == b"x"
        pool = r.connection_pool
        assert pool.connection_class is redis.SSLConnection
        assert pool.connection_kwargs["ssl_ca_certs"] == secured.ca
        assert pool.connection_kwargs["ssl_cert_reqs"] == "required"
    finally:
        r.close()


def test_wrong_password_is_refused_without_showing_it(secured, ca_env):
    wrong = "Wr0ng-s3cret"
    with pytest.raises(StoreError) as err:
        connect(secured.url(f"{USER}:{wrong}@"), timeout_s=5)
    message = str(err.value)
    assert wrong not in message and PASSWORD not in message
    assert f"rediss://***@127.0.0.1:{secured.port}/0 is unreachable" in message
    assert "invalid username-password pair" in message


def test_default_user_is_refused(secured, ca_env):
    # redis-py 8 opens with HELLO, which the server refuses before any AUTH
    with pytest.raises(StoreError, match="Authentication required|already authenticated"):
        connect(secured.url(userinfo=""), timeout_s=5)
    with pytest.raises(StoreError, match="invalid username-password pair or user is disabled"):
        connect(secured.url(userinfo="default:@"), timeout_s=5)


def test_plain_client_cannot_talk_to_the_tls_port(secured, ca_env):
    with pytest.raises(StoreError, match=rf"redis://\*\*\*@127\.0\.0\.1:{secured.port}/0 is unreachable"):
        connect(secured.url(scheme="redis"), timeout_s=2)


def test_tls_to_an_unknown_ca_is_refused(secured, no_ca_env):
    with pytest.raises(StoreError, match="certificate verify failed"):
        connect(secured.url(), timeout_s=5)


def test_acl_refuses_keys_outside_the_overlord_prefix(secured, ca_env):
    r = connect(secured.url(), timeout_s=5)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.set("other:key", b"v")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.get("other:key")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.eval("return redis.call('SET', KEYS[1], 'v')", 1, "other:key")
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.flushall()  # a @dangerous command
        r.set(Keys("acl").layout, b"v")  # its own prefix still works on the same connection
    finally:
        r.close()
    assert secured.admin.exists("other:key") == 0
    assert secured.admin.get(Keys("acl").layout) == b"v"


# a trainer rank that starts the job's sidecar itself (DataLoader's spawn path) and
# prints how many samples one epoch gave it
_TRAINER = """
import sys
from overlord.torch import DataLoader
loader = DataLoader(sys.argv[1])
print(sum(len(loader.last_meta["keys"]) for _ in loader))
loader.close()
"""


def _values(admin: redis.Redis, key: bytes) -> bytes:
    """Every byte a key holds, whatever its type."""
    kind = admin.type(key)
    if kind == b"string":
        return admin.get(key) or b""
    if kind == b"hash":
        return b"".join(k + v for k, v in admin.hgetall(key).items())
    if kind == b"list":
        return b"".join(admin.lrange(key, 0, -1))
    if kind == b"set":
        return b"".join(admin.smembers(key))
    if kind == b"zset":
        return b"".join(m for m, _ in admin.zrange(key, 0, -1, withscores=True))
    if kind == b"stream":
        return b"".join(k + v for _, fields in admin.xrange(key) for k, v in fields.items())
    return b""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape_up(port: int, sidecar: subprocess.Popen, timeout: float = 30) -> None:
    """Wait until the sidecar's /metrics says its Redis answers (the metrics process
    logged in with the password its environment carries)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            if any(line.startswith("overlord_up{") and line.endswith(" 1.0") for line in text.splitlines()):
                return
        except OSError:
            pass
        assert sidecar.poll() is None, f"the sidecar exited with {sidecar.returncode}"
        assert time.monotonic() < deadline, "/metrics never said overlord_up 1"
        time.sleep(0.2)


def _run_job(secured, tmp_path, monkeypatch, config_for, *, own_sidecar: bool) -> tuple[Job, str]:
    """Run one epoch of a job on `secured`: `overlord sidecar` started first (with
    /metrics), or a trainer that spawns its sidecar (DataLoader's spawn path). Returns
    the job and everything the processes printed."""
    corpus = generate_corpus(
        tmp_path / "corpus",
        seed=3,
        text_sources=1,
        image_sources=0,
        rows_per_source=96,
        files_per_source=1,
        row_group_size=32,
    )
    ((name, files),) = corpus.items()
    port = _free_port() if own_sidecar else None
    job = Job(
        name=f"pw{os.getpid() % 10000}",
        sources=(Source(name=name, paths=tuple(files), transform=TEXT_TRANSFORM),),
        mesh=Mesh(dp=1),
        batch=BatchSpec(global_batch=8, micro_batches=2, context_length=256, ring_bytes=1 << 20),
        epochs=1,
        redis_url=secured.url(),
        run_dir=str(tmp_path / "run"),
        timeout_s=20.0,
        sample_ring_bytes=1 << 20,
        buffer_samples=64,
        metrics_port=port,
    )
    config = tmp_path / "job.json"
    config.write_text(json.dumps(config_for(job)))
    config.chmod(0o600)  # the user's own config file
    monkeypatch.setenv("OVERLORD_LOG", "DEBUG")  # every log line a role may write
    said = tmp_path / "sidecar.out"
    sidecar = None
    try:
        if own_sidecar:
            with open(said, "wb") as out:
                sidecar = subprocess.Popen(
                    [sys.executable, "-m", "overlord.cli", "sidecar", "--config", str(config), "--exit-when-idle"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            _scrape_up(port, sidecar)
        done = subprocess.run(
            [sys.executable, "-c", _TRAINER, str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, RANK="0", WORLD_SIZE="1"),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert int(done.stdout.split()[-1]) == 96, done.stdout  # one epoch, every sample once
        if sidecar is not None:
            assert sidecar.wait(timeout=60) == 0, said.read_text()
        deadline = time.monotonic() + 60
        while sidecar_running(job):  # a spawned sidecar exits once its trainer is gone
            assert time.monotonic() < deadline, "the sidecar did not exit after its trainer"
            time.sleep(0.1)
    finally:
        if sidecar is not None and sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait(timeout=30)
        left = list_segments(job.name)
        unlink_all(job.name)
    assert not left, f"shared-memory segments left behind: {left}"
    return job, done.stdout + done.stderr + (said.read_text() if said.exists() else "")


def _assert_password_nowhere(secured, job: Job, output: str, files_made: set[str]) -> None:
    keys = list(secured.admin.scan_iter(match=f"{Keys(job.name).base}*", count=1000))
    assert Keys(job.name).job_config.encode() in keys, keys  # the job ran and published its config
    for key in keys:
        assert PASSWORD.encode() not in _values(secured.admin, key), f"the Redis password is in {key!r}"
    stored = json.loads(secured.admin.get(Keys(job.name).job_config))
    assert stored["redis_url"] == f"rediss://{USER}@127.0.0.1:{secured.port}/0"  # the user stays, the password goes
    files = [p for p in job.run_path.rglob("*") if p.is_file()]
    assert files_made <= {p.name for p in files}, files
    for path in files:
        assert PASSWORD.encode() not in path.read_bytes(), f"the Redis password is in {path}"
    assert PASSWORD not in output


def test_a_password_in_the_config_file_reaches_every_role_but_nothing_stored(secured, ca_env, tmp_path, monkeypatch):
    """`overlord sidecar` with the password in the user's config: its roles and its
    metrics process log in with it (from their environment), and nothing stores it."""
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)
    job, output = _run_job(
        secured, tmp_path, monkeypatch, lambda job: {**job.to_dict(), "redis_url": job.redis_url}, own_sidecar=True
    )
    _assert_password_nowhere(secured, job, output, {"job.json", "loader0.log", "planner0.log", "metrics.log"})


def test_a_spawned_sidecar_gets_the_configs_password_in_its_environment_not_a_file(
    secured, ca_env, tmp_path, monkeypatch
):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)
    job, output = _run_job(
        secured, tmp_path, monkeypatch, lambda job: {**job.to_dict(), "redis_url": job.redis_url}, own_sidecar=False
    )
    _assert_password_nowhere(secured, job, output, {"job.json", "spawned-job.json", "sidecar.log", "loader0.log"})


def test_a_password_from_a_0600_file_named_in_the_environment(secured, ca_env, tmp_path, monkeypatch):
    secret = tmp_path / "redis.pw"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o600)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret))
    # no password in the config; the trainer spawns the sidecar, which spawns the roles
    job, output = _run_job(secured, tmp_path, monkeypatch, lambda job: job.to_dict(), own_sidecar=False)
    _assert_password_nowhere(secured, job, output, {"job.json", "spawned-job.json", "sidecar.log", "loader0.log"})


def test_a_password_file_others_may_read_is_refused(secured, ca_env, tmp_path, monkeypatch):
    secret = tmp_path / "redis.pw"
    secret.write_text(PASSWORD)
    secret.chmod(0o644)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret))
    with pytest.raises(ConfigError, match=rf"has mode 0644: others may read the Redis password; chmod 600 {secret}"):
        connect(secured.url(f"{USER}@"), timeout_s=5)
    secret.chmod(0o600)
    r = connect(secured.url(f"{USER}@"), timeout_s=5)
    try:
        assert r.set(Keys("pwfile").layout, b"v")
    finally:
        r.close()


@pytest.mark.parametrize(
    "url, stored, password",
    [
        ("rediss://overlord:s3cret@h:6380/0", "rediss://overlord@h:6380/0", "s3cret"),
        ("redis://:Pw-only-1@h/1", "redis://@h/1", "Pw-only-1"),
        ("redis://u:p%40ss@w@rd@h/0", "redis://u@h/0", "p@ss@w@rd"),  # the last @ ends the userinfo
        ("redis://h:6379/0?password=Qu3ry-pw&db=2", "redis://h:6379/0?db=2", "Qu3ry-pw"),
        ("unix://u:Sock-pw@/run/redis.sock?db=0", "unix://u@/run/redis.sock?db=0", "Sock-pw"),
        ("redis://u@h/0", "redis://u@h/0", None),
        ("unix:///run/overlord/redis.sock", "unix:///run/overlord/redis.sock", None),
    ],
)
def test_the_stored_url_has_no_password(url, stored, password):
    assert split_redis_password(url) == (stored, password)
    job = Job(name="urls", sources=(Source(name="s", paths=("x",)),), redis_url=url)
    assert job.to_dict()["redis_url"] == stored and (password is None or password not in job.to_json())
    assert job.redis_url == url  # the process that was given it keeps it
    assert password is None or password not in repr(job)  # a repr lands in logs
    assert password is None or password not in redact(url)


def test_the_environment_password_is_for_urls_without_one_never_for_the_embedded_socket(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    monkeypatch.delenv(PASSWORD_FILE_ENV, raising=False)
    assert env_password("rediss://overlord@h:6380/0") == "from-env"
    assert env_password("redis://h:6379/0") == "from-env"
    assert env_password("rediss://overlord:own@h:6380/0") is None  # the URL's own wins
    assert env_password("unix:///run/overlord/redis.sock") is None  # the embedded server has no password
    assert env_password("unix://@/run/redis.sock") == "from-env"  # an external socket with a user part
