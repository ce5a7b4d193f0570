"""The capture context calls its participants in the order the custom all-reduce needs."""

import pytest

from fdlite.phases import PhaseRecorder
from fdlite.kernels.allreduce.capture import (capture_custom_allreduce, is_capturing_custom_allreduce,
                                          register_capture_participant, unregister_capture_participant)


class Recorder:
    def __init__(self):
        self.calls = []

    def begin_capture(self):
        self.calls.append(("begin", is_capturing_custom_allreduce()))

    def end_capture(self, register=True):
        self.calls.append(("end", register))
        return 0


@pytest.fixture
def comm():
    c = Recorder()
    register_capture_participant(c)
    yield c
    unregister_capture_participant(c)


def test_begin_once_and_register_at_outermost_exit(comm):
    rec = PhaseRecorder()
    assert not is_capturing_custom_allreduce()
    with capture_custom_allreduce(rec):
        assert is_capturing_custom_allreduce()
        with capture_custom_allreduce():  # nested: no second begin/end
            pass
        assert comm.calls == [("begin", False)]
    assert comm.calls == [("begin", False), ("end", True)]
    assert not is_capturing_custom_allreduce()
    assert [e.kind for e in rec.events] == ["begin", "end"]


def test_failed_capture_registers_nothing(comm):
    with pytest.raises(RuntimeError):
        with capture_custom_allreduce():
            raise RuntimeError("capture failed")
    assert comm.calls == [("begin", False), ("end", False)]
    assert not is_capturing_custom_allreduce()
