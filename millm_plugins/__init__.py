"""Feature plugins shipped with millm; each is enabled or disabled by the allow-list."""
