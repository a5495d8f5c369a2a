"""This checkout's packages for the bench scripts, without the checkout's root on sys.path.

The root holds kernels/, which imports as ``alignaudit_kernels`` once installed (pyproject.toml's package-dir) but as
``kernels`` wherever the root itself is on sys.path. transformers >= 5.25 depends on the Hugging Face ``kernels``
package and imports it; with the root first on sys.path it gets ours and fails ("cannot import name
'CUDAProperties' from 'kernels'", seen with transformers 5.25.0, 2026-12-06; alignaudit.workers.spawn.python_module
says the same for the engine workers). So the bench scripts import from a folder of links instead, one link per
package of this checkout (:data:`PACKAGES`), and export it on PYTHONPATH, so the processes they start (engine
workers, one process per configuration) import the same code.

Stdlib only: it runs before anything of this checkout can be imported. A script starts with::

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.checkout import use_this_checkout
    use_this_checkout()

``python3 bench/checkout.py`` prints the folder (bench/gpu_run.sh puts it on PYTHONPATH).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"alignaudit": "alignaudit", "alignaudit_kernels": "kernels", "alignaudit_fixtures": "fixtures",
            "bench": "bench"}  # import name: folder in the checkout


def import_folder(root: Path = ROOT) -> Path:
    """A folder holding one symbolic link per package of ``root`` (:data:`PACKAGES`), and nothing else.

    It is ``<tmp>/alignaudit-imports-<uid>-<12 hex of sha256(root)>``, made on first use and reused; where that
    folder is not this user's, others may write to it, or it holds anything but these links, a fresh private folder
    (tempfile.mkdtemp, left behind: a few links) is used instead, so nobody else's code can be imported from it.

    Raises:
        OSError: the links cannot be made (no writable temporary folder, or no symbolic links on this filesystem).
    """
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"alignaudit-imports-{os.getuid()}-{digest}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
        if folder.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise FileExistsError(folder)
        if {p.name for p in folder.iterdir() if not p.name.startswith(".")} - set(PACKAGES):
            raise FileExistsError(folder)  # something besides the links
        _link_packages(folder, root)
    except (FileExistsError, IsADirectoryError, NotADirectoryError):
        folder = Path(tempfile.mkdtemp(prefix="alignaudit-imports-"))
        _link_packages(folder, root)
    return folder


def _link_packages(folder: Path, root: Path) -> None:
    for name, source in PACKAGES.items():
        link, target = folder / name, root / source
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.exists() and not link.is_symlink():
            raise FileExistsError(link)
        staged = folder / f".{name}.{os.getpid()}"  # made beside it, then renamed over it: atomic for a reader
        staged.unlink(missing_ok=True)
        staged.symlink_to(target, target_is_directory=True)
        os.replace(staged, link)


def use_this_checkout(root: Path = ROOT) -> Path:
    """Import this checkout's packages from :func:`import_folder` rather than from ``root``: the root leaves
    sys.path, the folder goes first on sys.path and on PYTHONPATH (for child processes). Returns the folder.

    Raises:
        ImportError: a module from the root is already imported under a name the root shadows (``kernels``): the
            caller put the root on sys.path and imported from it before calling this.
    """
    folder = import_folder(root)
    shadowed = sys.modules.get("kernels")
    if shadowed is not None and str(getattr(shadowed, "__file__", "")).startswith(str(root / "kernels")):
        raise ImportError(f"{root / 'kernels'} was imported as 'kernels' before use_this_checkout(): call it first")
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    sys.path.insert(0, str(folder))
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != root]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder), *kept])
    return folder


if __name__ == "__main__":
    print(import_folder())
