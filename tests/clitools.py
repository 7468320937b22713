"""Running ``ngramspec`` subcommands in-process from tests."""
from types import SimpleNamespace

from ngramspec.cli import main


def cli(capsys, *argv):
    """``ngramspec ARGV`` in-process (fast); the same result fields as subprocess.run."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out, stderr=err)
