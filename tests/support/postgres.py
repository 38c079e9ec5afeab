"""A throwaway PostgreSQL cluster for tests: Debian's `postgresql` package, no network beyond one
loopback address, everything in a temp dir.

initdb and postgres refuse to run as root, so as root the cluster runs as the `postgres` user
that Debian's package creates (else `nobody`), in a directory it owns.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path


def pg_bin(name: str) -> str:
    """A PostgreSQL program: Debian keeps them in /usr/lib/postgresql/<version>/bin."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                   key=lambda p: int(Path(p).parts[4]) if Path(p).parts[4].isdigit() else 0)
    if found:
        return found[-1]
    on_path = shutil.which(name)
    if on_path:
        return on_path
    raise RuntimeError(f"PostgreSQL's {name} not found: install Debian's `postgresql` package "
                       "(scripts/setup.sh --test)")


def _run_as() -> str | None:
    if os.geteuid() != 0:
        return None
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
            return user
        except KeyError:
            continue
    raise RuntimeError("running as root and there is no `postgres` or `nobody` user for initdb")


class PostgresCluster:
    """`start()` a cluster on host:port with a superuser (`admin`, a random password)."""

    def __init__(self, host: str, port: int = 5432) -> None:
        self.host, self.port = host, port
        self.admin = "sandgate_admin"
        self.admin_password = f"pgadmin-{secrets.token_hex(8)}"
        self.dir = Path(tempfile.mkdtemp(prefix="sandgate-fleetsecrets-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.user = _run_as()

    def _cmd(self, *argv: str) -> list[str]:
        return ["runuser", "-u", self.user, "--", *argv] if self.user else list(argv)

    def start(self) -> PostgresCluster:
        pwfile = self.dir / "pw"
        pwfile.write_text(self.admin_password + "\n")
        if self.user:
            info = pwd.getpwnam(self.user)
            for p in (self.dir, pwfile):
                os.chown(p, info.pw_uid, info.pw_gid)
        subprocess.run(self._cmd(pg_bin("initdb"), "-D", str(self.data), "-U", self.admin,
                                 f"--pwfile={pwfile}", "--auth-host=scram-sha-256",
                                 "--auth-local=trust", "--no-sync", "-E", "UTF8"),
                       check=True, capture_output=True, cwd=str(self.dir))
        pwfile.unlink()
        hba = self.data / "pg_hba.conf"
        hba.write_text(hba.read_text() + "host all all 127.0.0.0/8 scram-sha-256\n")
        opts = (f"-c listen_addresses={self.host} -c port={self.port} "
                f"-c unix_socket_directories={self.dir} -c fsync=off")
        subprocess.run(self._cmd(pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log),
                                 "-o", opts, "-w", "-t", "30", "start"),
                       check=True, capture_output=True, cwd=str(self.dir))
        return self

    def stop(self) -> None:
        subprocess.run(self._cmd(pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate",
                                 "-w", "stop"), capture_output=True, cwd=str(self.dir))
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def admin_url(self) -> str:
        """The connection URL template OpenBao's database engine wants."""
        return (f"postgresql://{{{{username}}}}:{{{{password}}}}@{self.host}:{self.port}/"
                "postgres?sslmode=disable")

    def can_login(self, user: str, password: str) -> bool:
        """Does `user`/`password` log in over TCP? (psql; the password never on a command
        line or in output)"""
        env = {**os.environ, "PGPASSWORD": password, "PGCONNECT_TIMEOUT": "5"}
        r = subprocess.run([pg_bin("psql"), "-h", self.host, "-p", str(self.port), "-U", user,
                            "-d", "postgres", "-tAc", "select current_user"],
                           env=env, capture_output=True, text=True, timeout=20)
        return r.returncode == 0 and r.stdout.strip() == user
