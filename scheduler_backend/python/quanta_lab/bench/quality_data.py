"""Fixed inputs of the quality checks: chat questions with short factual answers, and a
public-domain text for perplexity.

Why fixed and embedded: a quality figure is only comparable across runs, machines and peers
when every run reads the same bytes; none of this may come from the network.
"""

from __future__ import annotations

# Questions a small instruct model answers in a sentence; greedy answers end at EOS well
# within the token budget the checks give them.
CHAT_QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Translate 'thank you' into Spanish.",
    "What planet is known as the red planet?",
    "Give me a synonym for happy.",
    "How many days are in a week?",
    "What is the largest ocean on Earth?",
    "What gas do plants take in from the air?",
    "What is the opposite of cold?",
    "Write one sentence about the sea.",
    "What is the chemical symbol for gold?",
    "How many legs does a spider have?",
    "What language is spoken in Brazil?",
    "Name a fruit that is yellow.",
    "What is the square root of 81?",
    "Who painted the Mona Lisa?",
    "What do bees make?",
    "Suggest a name for a pet cat.",
    "What is the freezing point of water in Fahrenheit?",
)

# Public domain: Abraham Lincoln's Gettysburg Address (1863, the Bliss copy) and the Preamble
# to the Constitution of the United States (1787).
PERPLEXITY_TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so \
conceived and so dedicated, can long endure. We are met on a great battle-field of that war. \
We have come to dedicate a portion of that field, as a final resting place for those who here \
gave their lives that that nation might live. It is altogether fitting and proper that we \
should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- \
this ground. The brave men, living and dead, who struggled here, have consecrated it, far \
above our poor power to add or detract. The world will little note, nor long remember what we \
say here, but it can never forget what they did here. It is for us the living, rather, to be \
dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced. It is rather for us to be here dedicated to the great task remaining before us -- \
that from these honored dead we take increased devotion to that cause for which they gave the \
last full measure of devotion -- that we here highly resolve that these dead shall not have \
died in vain -- that this nation, under God, shall have a new birth of freedom -- and that \
government of the people, by the people, for the people, shall not perish from the earth.

We the People of the United States, in Order to form a more perfect Union, establish Justice, \
insure domestic Tranquility, provide for the common defence, promote the general Welfare, and \
secure the Blessings of Liberty to ourselves and our Posterity, do ordain and establish this \
Constitution for the United States of America.
"""
