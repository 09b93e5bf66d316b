"""The end of the warm start: the student's greedy figures beside the teacher's on the same suite, and one warning
line when the student is far below the teacher (a too-short warm start looks fine in its loss alone)."""

from reno_jax.envs import interface
from reno_jax.loop import warmstart


class _Env:
    def episode_metrics(self):
        return {"success_rate": interface.rate("success", plot=True), "invalid_rate": interface.rate("invalid")}


def _compared(student_success):
    return {
        "student/maps/success_rate": student_success,
        "student/maps/invalid_rate": 0.0,
        "teacher/maps/success_rate": 1.0,
        "teacher/maps/invalid_rate": 0.0,
    }


def test_the_student_is_printed_beside_the_teacher(capsys):
    assert warmstart.report_against_teacher(_compared(0.75), _Env()) is None
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "Warm start on 'maps', student: success_rate 0.750, invalid_rate 0.000",
        "Warm start on 'maps', teacher: success_rate 1.000, invalid_rate 0.000",
    ]


def test_a_student_under_half_the_teacher_is_one_warning(capsys):
    warning = warmstart.report_against_teacher(_compared(0.0), _Env())
    assert warning.startswith("Warning: the warm-started student's success_rate on 'maps' (0.000) is under half")
    assert capsys.readouterr().out.splitlines()[-1] == warning
    assert warmstart.report_against_teacher({}, _Env()) is None  # no suite or no teacher: nothing to say
