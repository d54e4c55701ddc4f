"""Engine plugins shipped with millm. Each subpackage imports its heavy library only
inside its engine module."""
