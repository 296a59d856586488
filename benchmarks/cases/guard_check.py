"""placeholder"""
NAME = "guard_check"
TITLE = "guard_check"


def run(settings):
    return []
