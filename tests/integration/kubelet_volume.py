"""A ConfigMap volume as the kubelet lays it out and updates it.

The kubelet's atomic writer (`pkg/volume/util/atomic_writer.go`) keeps each
version of the ConfigMap's files in a hidden directory named after the time
(`..2024_05_01_12_00_00.123456789`), points the `..data` symlink at the
current one, and makes every key a symlink through it
(`policy.yaml -> ..data/policy.yaml`). An update writes the new version into
a new timestamped directory, points a `..data_tmp` symlink at it, renames
`..data_tmp` over `..data` (the one atomic step: a reader sees the old files
or the new ones, never a mix), adds or removes the key symlinks, and deletes
the old directory. The files a process opened by their mounted path are
therefore symlinks whose target changes in one rename.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

DATA = "..data"
DATA_TMP = "..data_tmp"


class ConfigMapVolume:
    """The mount point of a ConfigMap volume (`volumeMounts[].mountPath`)."""

    def __init__(self, root: Path, files: Mapping[str, str]) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.versions: list[str] = []
        self.update(files)

    def _new_version_dir(self) -> Path:
        now = time.time_ns()
        stamp = time.strftime("%Y_%m_%d_%H_%M_%S", time.gmtime(now // 1_000_000_000))
        path = self.root / f"..{stamp}.{now % 1_000_000_000:09d}"
        path.mkdir(mode=0o755)
        return path

    def update(self, files: Mapping[str, str], same_stat_as_before: bool = False) -> None:
        """Publish a new version of the files the kubelet's way.

        `same_stat_as_before`: give each file that existed before the old
        file's mtime (where sizes match, the stamp (mtime, size) of the
        mounted path is then unchanged — only the inode moved)."""
        old = os.readlink(self.root / DATA) if (self.root / DATA).is_symlink() else None
        new_dir = self._new_version_dir()
        for name, text in files.items():
            target = new_dir / name
            target.write_text(text, encoding="utf-8")
            os.chmod(target, 0o644)
            if same_stat_as_before and old is not None and (self.root / old / name).exists():
                st = os.stat(self.root / old / name)
                os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        # ..data_tmp -> the new directory, then renamed over ..data (atomic).
        tmp = self.root / DATA_TMP
        if tmp.is_symlink():
            tmp.unlink()
        os.symlink(new_dir.name, tmp)
        os.rename(tmp, self.root / DATA)
        # Key symlinks: one per file, through ..data; keys gone are removed.
        for name in files:
            link = self.root / name
            if not link.is_symlink():
                os.symlink(f"{DATA}/{name}", link)
        for entry in self.root.iterdir():
            if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in files:
                entry.unlink()
        if old is not None:
            shutil.rmtree(self.root / old)
        self.versions.append(new_dir.name)
