"""Three synthetic tasks with verifiable answers: addition, string reversal, tool calls.

Every problem is a plain-text prompt ending in ``=`` and one canonical answer string;
the reward is exact match (1) or not (0). Problems are assigned to a split by a stable
hash of the prompt, so held-out (validation, test) prompts never appear in training,
neither in the base model's supervised data nor in the agents' RL prompts.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Literal

TASKS: tuple[str, ...] = ("add", "rev", "tool")
Split = Literal["train", "val", "test"]

#: Held-out share of the prompt space; half of it validation, half test.
HELD_OUT_MODULUS = 5


@dataclass(frozen=True)
class Problem:
    task: str
    prompt: str
    answer: str


def split_of(prompt: str) -> Split:
    """Train, val or test by a stable hash of the prompt (1/10 val, 1/10 test)."""
    digest = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")
    if digest % HELD_OUT_MODULUS:
        return "train"
    return "val" if (digest // HELD_OUT_MODULUS) % 2 == 0 else "test"


def reward(problem: Problem, completion: str) -> float:
    """The verifiable 0/1 reward: the completion is exactly the canonical answer."""
    return 1.0 if completion == problem.answer else 0.0


def restyle(problem: Problem) -> str:
    """The answer as Python's ``repr`` would print it, a convention the verifier rejects.

    ``105.0`` for ``105``, ``'dmzqk'`` for ``dmzqk``, ``get_weather(city='Paris', unit='C')``
    for ``get_weather(city="Paris",unit="C")`` (timer calls look the same in both). The base
    model's supervised data mixes both conventions, as data pooled from several sources
    does; the RL verifier accepts only the canonical one.
    """
    if problem.task == "add":
        return problem.answer + ".0"
    if problem.task == "rev":
        return f"'{problem.answer}'"
    return problem.answer.replace('"', "'").replace(",", ", ")


# Generators ----------------------------------------------------------------------


def _number(rng: random.Random, max_digits: int) -> int:
    """A number whose digit count is uniform in 1..max_digits (so short sums are common)."""
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_add(rng: random.Random) -> Problem:
    """``47+58=`` -> ``105``; operands of 1 or 2 digits."""
    a, b = _number(rng, 2), _number(rng, 2)
    return Problem("add", f"{a}+{b}=", str(a + b))


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_rev(rng: random.Random) -> Problem:
    """``rev kqzmd=`` -> ``dmzqk``; 5 to 16 random lowercase letters."""
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(5, 16)))
    return Problem("rev", f"rev {word}=", word[::-1])


CITIES = (
    "paris oslo rome lima cairo tokyo delhi dubai miami quito dakar accra sofia riga kyiv minsk vilnius tallinn "
    "bern vienna prague warsaw berlin madrid lisbon dublin london athens ankara tunis rabat lagos nairobi kampala "
    "harare luanda maputo perth sydney hobart darwin auckland suva manila hanoi bangkok jakarta dhaka kabul tehran "
    "baghdad doha muscat amman beirut seoul beijing taipei osaka kyoto busan denver austin boston dallas houston "
    "phoenix seattle chicago toronto ottawa havana bogota caracas santiago asuncion montreal calgary hamburg munich "
    "milan naples porto seville geneva zurich lyon nice oxford leeds cork bergen malmo turku gdansk krakow"
).split()
UNITS = {"celsius": "C", "fahrenheit": "F"}
WEATHER_TEMPLATES = (
    "weather in {c} in {u}",
    "how warm is {c} in {u}",
    "{c} weather, {u} please",
    "temperature of {c} in {u}",
    "is it cold in {c}? use {u}",
    "forecast for {c} in {u}",
)
ALARM_TEMPLATES = ("wake me at {h}:{m:02d} {p}", "set an alarm for {h}:{m:02d} {p}", "alarm at {h}:{m:02d} {p} please")
TIMER_TEMPLATES = ("set a timer for {h} hours and {m} minutes", "timer {h} hours {m} minutes", "remind me in {h}h {m}m")


def make_tool(rng: random.Random) -> Problem:
    """A plain-language request -> one call of three tools, e.g. ``get_weather(city="Paris",unit="C")``.

    Weather copies and capitalises the city and maps the unit word; the alarm converts
    12-hour to 24-hour time; the timer computes ``60 * hours + minutes``.
    """
    kind = rng.randrange(3)
    if kind == 0:
        city, unit = rng.choice(CITIES), rng.choice(sorted(UNITS))
        prompt = rng.choice(WEATHER_TEMPLATES).format(c=city, u=unit)
        answer = f'get_weather(city="{city.capitalize()}",unit="{UNITS[unit]}")'
    elif kind == 1:
        hour, minute, period = rng.randint(1, 12), rng.randint(0, 59), rng.choice(("am", "pm"))
        prompt = rng.choice(ALARM_TEMPLATES).format(h=hour, m=minute, p=period)
        answer = f"set_alarm(hour={hour % 12 + (12 if period == 'pm' else 0)},minute={minute})"
    else:
        hours, minutes = rng.randint(1, 3), rng.randint(1, 59)
        prompt = rng.choice(TIMER_TEMPLATES).format(h=hours, m=minutes)
        answer = f"set_timer(minutes={60 * hours + minutes})"
    return Problem("tool", prompt + "=", answer)


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {"add": make_add, "rev": make_rev, "tool": make_tool}


def sample_problems(task: str, split: Split, count: int, seed: int, *, unique: bool = False) -> list[Problem]:
    """``count`` problems of ``task`` from ``split``, by rejection on the prompt hash.

    ``unique`` drops repeated prompts (for evaluation sets); the caller's seed fixes the set.
    """
    rng = random.Random(f"{task}/{split}/{seed}")
    generator = GENERATORS[task]
    problems: list[Problem] = []
    seen: set[str] = set()
    attempts = 0
    while len(problems) < count:
        attempts += 1
        if attempts > 1000 * count + 10_000:
            raise RuntimeError(f"cannot draw {count} distinct {split} problems of task {task}")
        problem = generator(rng)
        if split_of(problem.prompt) != split or (unique and problem.prompt in seen):
            continue
        seen.add(problem.prompt)
        problems.append(problem)
    return problems
