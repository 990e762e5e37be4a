"""The directory an export goes to: a target that is not ours to replace is
refused, and the export is written to a temporary sibling and renamed onto it,
so the directory is always either the old export or the new one, complete."""

import os
import shutil
import tempfile
import warnings
from typing import Any

from .. import _files
from ._errors import HFExportExistsError, HFExportWarning


_KEPT = "will not be overwritten (not even with --overwrite / overwrite=True)"


def check_target(out_dir: str, overwrite: bool) -> None:
    """Refuse a target that is not ours to replace: a file, a non-empty directory
    that is not an export, or an export that also holds a user's files (whatever
    `overwrite` says: replacing it would delete them), or, without `overwrite`,
    an earlier export."""
    if not os.path.lexists(out_dir):
        return
    problem = _not_ours(out_dir)
    if problem is not None:
        raise HFExportExistsError(problem)
    if os.listdir(out_dir) and not overwrite:
        raise HFExportExistsError(
            f"{out_dir} already exists and holds an earlier export; pass "
            "--overwrite (overwrite=True) to replace it, or export to a new "
            "directory."
        )


def _not_ours(out_dir: str) -> str | None:
    """Why an existing `out_dir` must be kept whatever `overwrite` says, if it must."""
    if not os.path.isdir(out_dir):
        return (
            f"{out_dir} exists and is not a directory, so it is not an export and "
            f"{_KEPT}. Export to a new directory."
        )
    names = os.listdir(out_dir)
    return _not_an_export(out_dir, names) if names else None


def _not_an_export(out_dir: str, names: list[str]) -> str | None:
    """Why a non-empty `out_dir` is not an export we may replace, if it is not."""
    foreign = _files.foreign_files(out_dir)
    if "config.json" not in names and "adapter_config.json" not in names:
        return (
            f"{out_dir} is not empty ({_files.describe_names(foreign or names)}) "
            "and holds no config.json (nor an adapter's), so it is not an earlier "
            f"export and {_KEPT}. Export to a new directory."
        )
    if foreign:
        return (
            f"{out_dir} holds an earlier export and also files that are not part "
            f"of one ({_files.describe_names(foreign)}), which replacing it would "
            f"delete, so it {_KEPT}. Move those files out of it, or export to a new "
            "directory."
        )
    return None


class atomic_dir:  # noqa: N801 -- used as a context manager
    """A temporary sibling of `out_dir`, renamed onto it on success."""

    def __init__(self, out_dir: str, overwrite: bool):
        self.out_dir, self.overwrite = os.path.abspath(out_dir), overwrite
        self.tmp = ""

    def __enter__(self) -> str:
        parent, name = os.path.split(self.out_dir)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        _files.set_default_mode(self.tmp)  # mkdtemp's 0700 is for secrets
        return self.tmp

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        try:  # again: a user may have put files there while it was written
            check_target(self.out_dir, self.overwrite)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self._replace()

    def _replace(self) -> None:
        """Rename the temporary directory onto `out_dir`, replacing an old export.

        The old export is moved out of the way first: `out_dir` then never holds a
        mix of two exports (a crash between the renames leaves the old one at
        `<tmp>.old`)."""
        old = None
        if os.path.lexists(self.out_dir):
            old = self.tmp + ".old"
            os.rename(self.out_dir, old)
        os.rename(self.tmp, self.out_dir)
        if old is not None:
            _remove_export(old)


def _remove_export(path: str) -> None:
    """Delete an old export's own files only: a file that appeared in it after the
    last check stays, with the directory, and is named in a warning."""
    foreign = _files.foreign_files(path)
    keep = {name.rstrip("/") for name in foreign}
    try:
        for name in os.listdir(path):
            if name == _files.TEMPLATE_DIR and name not in keep:
                _remove_templates(os.path.join(path, name))
            elif name not in keep:
                os.remove(os.path.join(path, name))
        if not foreign:
            os.rmdir(path)
            return
    except OSError:
        return  # the new export is in place; a leftover hidden directory is harmless
    warnings.warn(
        HFExportWarning(
            f"the earlier export was replaced, but {_files.describe_names(foreign)} "
            f"appeared in it meanwhile; they were kept in {path}. Move them where "
            "they belong."
        ),
        stacklevel=4,  # the `with` in `export` (past _replace and __exit__)
    )


def _remove_templates(path: str) -> None:
    """Delete an old export's folder of named chat templates: its `.jinja`
    files, then the folder (which a file that appeared meanwhile keeps)."""
    for entry in os.scandir(path):
        if entry.name.endswith(".jinja") and entry.is_file(follow_symlinks=False):
            os.remove(entry.path)
    os.rmdir(path)
