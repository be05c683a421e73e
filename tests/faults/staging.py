"""The staging root of a fault run on a tmpfs of its own, so that the ``fill-staging``
nemesis can fill it for real (the kernel's ENOSPC) without filling the machine's disk.

Mounting needs root (CAP_SYS_ADMIN); without it, or with ``size_mib`` 0, the staging
root stays a plain directory and ``fill-staging`` skips. The mount is released when
the run ends: its contents go with it, or, to keep them, are copied out first (the
staging root is then a plain directory with the same contents).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from baton_relay.kernel.contract import TEMP_MARKER


def temp_files(root: Path) -> list[str]:
    """The producer helper's temp files (``.NAME.baton-tmp-TOKEN-NONCE``) under ``root``,
    relative to it."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(f"*{TEMP_MARKER}*")
                  if p.is_file())


def staged_files(root: Path) -> set[str]:
    """Every regular file under ``root`` (no temp file), relative to it."""
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and TEMP_MARKER not in p.name}


class StagingFs:
    """A tmpfs of ``size_mib`` MiB mounted on ``root`` (an empty directory)."""

    def __init__(self, root: Path, size_mib: int) -> None:
        self.root = root
        self.size_mib = size_mib
        #: the tmpfs is mounted (until :meth:`release`)
        self.mounted = False
        #: the harness mounted it for this run
        self.was_mounted = False
        #: why the staging root is not a tmpfs ("" when it is)
        self.why_not = ""

    def describe(self) -> str:
        if self.was_mounted:
            return f"a {self.size_mib} MiB tmpfs"
        return f"a plain directory ({self.why_not})"

    def mount(self) -> bool:
        """Mount the tmpfs; False (and :attr:`why_not`) if it cannot be."""
        if self.size_mib <= 0:
            self.why_not = "no tmpfs asked for"
            return False
        if os.geteuid() != 0:
            self.why_not = "mounting a tmpfs needs root"
            return False
        mode = self.root.stat().st_mode & 0o7777
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m,mode={mode:o}",
             "faults-staging", str(self.root)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            self.why_not = f"mount failed: {(done.stderr or done.stdout).strip()[:200]}"
            return False
        self.mounted = self.was_mounted = True
        return True

    def release(self, keep: bool) -> str:
        """Unmount (every process using it must have stopped); with ``keep`` the
        contents are copied out first and stay at the same path. What was done."""
        if not self.mounted:
            return ""
        kept = self.root.with_name(self.root.name + ".kept")
        if keep:
            shutil.copytree(self.root, kept, symlinks=True)
        done = subprocess.run(["umount", str(self.root)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:  # still busy: detach it now, the kernel frees it later
            subprocess.run(["umount", "-l", str(self.root)], check=False)
        self.mounted = False
        if keep:
            self.root.rmdir()
            kept.rename(self.root)
            return f"staging copied out of its tmpfs to {self.root}"
        return "staging tmpfs unmounted"
