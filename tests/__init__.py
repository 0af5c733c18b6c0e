"""asynccoll's test suite, laid out like the package: one folder per room, helpers in support/."""
