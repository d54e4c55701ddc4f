"""``millm serve --ray``: the app as Ray Serve replicas behind one HTTP route. Importing
the package imports nothing of Ray: :mod:`.deployment` does."""
