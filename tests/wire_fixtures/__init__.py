"""Golden wire fixtures: frames of every message type, one committed set per protocol version.

Layout::

    tests/wire_fixtures/
        v1/frames.json   wire name -> frames: payload hex, to_uid, kind, repr and the decoded value
        v1/schema.json   wire name -> ordered fields (name, annotation, has default) or enum values
        _samples.py      the representative instances the frames are made from
        _golden.py       schema extraction, the compatibility rules, frame checks, file format
        regenerate.py    ``python -m tests.wire_fixtures.regenerate``: rewrites the current set

``tests/test_wire_golden.py`` decodes every committed set with the current code and checks every
committed schema against the current classes. ``docs/testing.md`` ("Golden wire fixtures") says
what to do when adding a message type or a field.
"""
