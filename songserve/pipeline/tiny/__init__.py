"""Writers of the tiny checkpoint sets (the project's own and the release-shaped one) for tests and first runs."""
