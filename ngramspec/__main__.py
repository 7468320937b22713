import sys

try:
    from ngramspec.cli import main
except KeyboardInterrupt:       # Ctrl-C while the command line is still being imported
    sys.stderr.write("interrupted\n")
    sys.exit(130)

sys.exit(main())
