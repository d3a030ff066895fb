"""`python -m infera_mock_engine ...` — same as the `infera-mock-engine` console script."""

from infera_mock_engine.main import main

if __name__ == "__main__":
    raise SystemExit(main())
