"""Evaluation texts, written for ATOM: `TEXT` (plain English prose, ~360 SmolLM2 tokens), the
default, and `HELD_OUT` (expository prose on another subject, ~290 tokens) for checking a
choice fitted on `TEXT` against text it has not seen."""

TEXT = """\
The lighthouse stood at the end of a narrow spit of land, where the river met the sea. For more than a \
century its keepers had climbed the same spiral stairs every evening to light the lamp, trim the wick and \
wind the clockwork that turned the great glass lens. The work was simple but it could not be skipped: a \
single dark night could send a ship onto the rocks that lay hidden just below the waves.

In the early years the lamp burned whale oil, which smoked and had to be cleaned from the glass each \
morning. Later it burned kerosene, brighter and cheaper, and finally electricity arrived along a line of \
wooden poles that followed the coast road. With electricity came an automatic switch, and with the switch \
the keepers were no longer needed. The last of them, an old man named Thomas, locked the door in the \
spring of 1962 and walked back along the spit to the village, carrying a small suitcase and the logbook \
he had kept for thirty years.

The logbook is now in the town museum. Its pages record the weather at dawn and dusk, the ships that \
passed, the storms that broke windows and the calm evenings when nothing happened at all. Visitors often \
expect drama, but most entries are short: wind from the west, light rain, lamp lit at six, all well. \
Reading them one after another, you begin to understand that the job was not about heroism. It was about \
paying attention, every day, to something that mattered only on the rare day when it failed.

Today the lighthouse is a small museum of its own. Children climb the stairs and look out over the water, \
and on clear nights the light still turns, steady and patient, as it has for as long as anyone can remember.
"""

HELD_OUT = """\
A bicycle wheel looks simple, but it is a careful piece of engineering. The rim is held to the hub by \
thirty or more thin steel spokes, and none of them is stiff enough to hold up a rider on its own. The \
trick is tension. Each spoke is pulled tight, so that the rim is squeezed evenly from every side, and when \
the rider sits down the spokes at the bottom lose a little of their tension while the others carry on as \
before. The wheel does not stand on its lower spokes; it hangs from all of them.

Building a wheel by hand takes patience. The builder laces the spokes in a pattern, usually crossing each \
one over three others, then turns the small nipples at the rim a quarter turn at a time. Too much tension \
on one side pulls the rim sideways; too little anywhere lets it wobble. A good builder checks the wheel \
against a gauge after every pass, listening as well as looking, because a spoke that is too loose sounds \
dull when plucked, like a string on an old guitar.

Modern factories build most wheels with machines, and they do it well. Yet many riders who race or travel \
long distances still ask for wheels built by hand. They are not paying for speed. They are paying for a \
wheel whose every spoke someone has touched, measured and trusted, so that on a fast descent far from \
home they never have to think about it at all.
"""
