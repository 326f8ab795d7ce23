"""Browser tests: the manager's status page in a real headless Chromium (selenium)."""
