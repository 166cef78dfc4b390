"""A default evaluation text (written for ATOM; plain English prose, ~400 tokens)."""

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
