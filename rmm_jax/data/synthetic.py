"""Built-in synthetic demo data: users chatting with an assistant about their lives.

Each user has a persona of facts (allergy, pet, job, trip, diet, hobby, family, ...)
that they mention in the first person, spread over sessions among varied small talk
(greetings, weather, TV, weekends, ...) and *distractors* (near-miss statements about
other people: "my coworker is allergic to shellfish"). Some facts are later
*superseded* ("I moved my piano lesson from Tuesday to Thursday"). Questions come after
their evidence:

* ``single-hop``  worded close to the evidence ("What am I allergic to?");
* ``paraphrase``  far from its wording ("I have a fever today, which antibiotics should
  my doctor avoid giving me?" for "I'm allergic to penicillin");
* ``update``      about a superseded fact; gold is the *latest* fact turn only;
* ``multi-hop``   needing two facts (gold = both turns).

A dense retriever finds many single-hop answers but fewer paraphrase / update ones, so a
learned reranker has room to improve. Everything is drawn from ``random.Random`` seeded
per (seed, user index): the same seed gives the same data, and user ``u`` does not
depend on how many users are requested. The number of facts per user saturates at the
number of fact kinds; extra fact slots become small talk.
"""
from __future__ import annotations

import datetime as _dt
import random
from collections import Counter
from dataclasses import dataclass

from rmm_jax.data.types import Dataset, Query, Session, Turn, User
from rmm_jax.errors import InputError

ASSISTANT = "Assistant"

USER_NAMES = ["Maya", "Daniel", "Priya", "Lucas", "Aisha", "Tom", "Sofia", "Kenji", "Elena", "Marcus",
              "Hannah", "Omar", "Chloe", "Ravi", "Isabel", "Jonas", "Grace", "Mateo", "Nadia", "Felix",
              "Leila", "Owen", "Zara", "Victor"]
FEMALE_NAMES = ["Emma", "Olivia", "Ava", "Mia", "Ruby", "Nora", "Lily", "Iris", "Clara", "Alice", "Rosa", "Julia",
                "Eva", "Stella"]
MALE_NAMES = ["Noah", "Liam", "Ethan", "Leo", "Jack", "Ben", "Max", "Hugo", "Theo", "Adam", "Finn", "Oscar", "Milo",
              "Felipe"]
OTHER_NAMES = FEMALE_NAMES + MALE_NAMES
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


@dataclass(frozen=True)
class FactKind:
    """A kind of persona fact: its values and the templates that talk / ask about it."""

    name: str
    values: tuple[dict, ...]      # template fields; optional "far": value-specific paraphrases
    statements: tuple[str, ...]   # first-person mention by the user
    replies: tuple[str, ...]      # the assistant's answer to the mention
    close: tuple[str, ...]        # questions worded like the statement
    far: tuple[str, ...]          # questions sharing little wording with the statement
    clause: str                   # "what I'm allergic to", for multi-hop conjunctions
    answer: str
    distractors: tuple[str, ...]  # near-miss statements; {alt_*} = another value's fields


@dataclass(frozen=True)
class UpdateKind:
    """A fact that is stated and later superseded; questions ask for the latest value."""

    name: str
    values: tuple[dict, ...]      # fields for both statements ({a}: old value, {b}: new value)
    old: tuple[str, ...]
    new: tuple[str, ...]
    replies: tuple[str, ...]
    questions: tuple[str, ...]
    answer: str
    distractors: tuple[str, ...]


def _v(**kw) -> dict:
    return kw


FACTS: tuple[FactKind, ...] = (
    FactKind(
        "allergy",
        (_v(x="penicillin", far=("I have a fever today, which antibiotics should my doctor avoid giving me?",
                                 "The pharmacist asked whether any medication has ever made me sick. What should I tell her?")),
         _v(x="peanuts", far=("We're ordering satay from the Thai place tonight. Is that a safe choice for me?",
                              "Which snacks should I stay away from at the ballgame?")),
         _v(x="shellfish", far=("My friends booked a seafood boil for Friday. What on that table could hurt me?",
                                "Should I order the shrimp scampi at the Italian place?")),
         _v(x="latex", far=("I'm seeing the dentist tomorrow. Should I warn them about anything they wear on their hands?",
                            "What should I mention to the nurse before my blood test?")),
         _v(x="bee stings", far=("We're planning a picnic in a meadow full of wildflowers. What should I be careful about?",
                                 "Is it risky for me to help my uncle with his beehives?")),
         _v(x="strawberries", far=("Which fruit should I leave out of the smoothie I'm making?",
                                   "Can I have the shortcake at the summer fair?"))),
        ("I found out I'm allergic to {x}, so I have to be really careful now.",
         "Just so you know, I'm seriously allergic to {x}.",
         "Ugh, I had a reaction again. My allergy to {x} is no joke."),
        ("That sounds scary. Do you carry medication with you?", "Thanks for telling me, I'll keep that in mind.",
         "Oh no, I hope the reaction wasn't too bad."),
        ("What am I allergic to?", "Which allergy did I tell you about?", "Do I have an allergy I should remember?"),
        ("I'm filling in a medical form. Is there anything my body reacts badly to?",),
        "what I'm allergic to", "{x}",
        ("My coworker {other} is allergic to {alt_x}, so we're careful at office lunches.",
         "I read an article about {alt_x} allergies becoming more common."),
    ),
    FactKind(
        "pet",
        tuple(_v(species=s, pet=p) for s, p in [("dog", "Biscuit"), ("cat", "Miso"), ("rabbit", "Clover"),
                                               ("parrot", "Kiwi"), ("dog", "Pepper"), ("cat", "Luna"),
                                               ("hamster", "Nugget"), ("dog", "Waffles")]),
        ("We adopted a {species} last weekend and named it {pet}.",
         "I finally got a pet! A little {species} called {pet}.",
         "My {species} {pet} chewed through my charger cable again this morning."),
        ("Aww, that's adorable! How is the little one settling in?", "Pets make a home so much warmer.",
         "Haha, sounds like a handful. Worth it though!"),
        ("What's my {species}'s name?", "What did I name my pet?", "What kind of pet do I have?"),
        ("Who will need someone to feed them while I'm away on vacation?",
         "Whose vet check-up should I be booking this month?",
         "Who is always waiting for me at the door when I come home?"),
        "my pet's name", "{pet} the {species}",
        ("My neighbor just got a {alt_species} named {alt_pet}. So cute.",
         "My friend {other} keeps sending me videos of her {alt_species}."),
    ),
    FactKind(
        "job",
        tuple(_v(job=j, place=p) for j, p in [("nurse", "St. Mary's Hospital"), ("software engineer", "a fintech startup"),
                                             ("chemistry teacher", "Lincoln High"), ("architect", "a small firm downtown"),
                                             ("pastry chef", "a French bakery"), ("accountant", "a logistics company"),
                                             ("physiotherapist", "a sports clinic"), ("librarian", "the city library")]),
        ("I just started a new job as a {job} at {place}.", "I got hired! I'm officially a {job} at {place} now.",
         "First week as a {job} at {place} went better than I expected."),
        ("Congratulations! That's a big step.", "That's exciting, how are your new colleagues?",
         "Wonderful news. I hope it's everything you wanted."),
        ("What is my job?", "Where do I work now?", "What job did I start recently?"),
        ("What should I write in the occupation field of this insurance form?",
         "Someone at a party asked what I do all day. How should I answer?",
         "Which professional conferences would be relevant for me?"),
        "what I do for work", "{job} at {place}",
        ("My cousin works as a {alt_job} and says it's exhausting.", "{other} is thinking about becoming a {alt_job}."),
    ),
    FactKind(
        "trip",
        tuple(_v(city=c, month=m, reason=r) for c, m, r in [
            ("Lisbon", "May", "a friend's birthday"), ("Kyoto", "April", "the cherry blossoms"),
            ("Reykjavik", "November", "the northern lights"), ("Buenos Aires", "March", "a tango festival"),
            ("Vancouver", "August", "a hiking trip"), ("Marrakesh", "October", "a photography tour"),
            ("Edinburgh", "December", "the winter markets"), ("Cape Town", "February", "my cousin's wedding")]),
        ("I booked flights to {city} for {month}, it's for {reason}.",
         "Big news: I'm going to {city} in {month} for {reason}!",
         "I just paid the hotel deposit for {city}. {month} can't come soon enough."),
        ("How exciting! Have you been there before?", "That sounds like an amazing trip.",
         "Nice, make sure to check the weather before packing."),
        ("Where am I traveling in {month}?", "Which city did I book a trip to?", "When is my trip and where to?"),
        ("Which time zone will I need to adjust to on my upcoming journey?",
         "What kind of power adapter should I pack for my getaway?",
         "Where will I be spending the vacation days I requested?"),
        "where I'm traveling to", "{city} in {month}",
        ("My friend {other} just got back from {alt_city} and loved it.", "I saw a documentary about {alt_city} last night."),
    ),
    FactKind(
        "diet",
        (_v(diet="vegetarian", far=("We're having a barbecue on Sunday. What should I bring to grill for myself?",)),
         _v(diet="vegan", far=("Can I have the cheesecake at the office party?",)),
         _v(diet="gluten-free", far=("Which kind of pasta should I buy for dinner?",)),
         _v(diet="pescatarian", far=("At the steakhouse, which dishes would fit what I eat?",)),
         _v(diet="on a low-sugar diet", far=("Should I get the caramel frappuccino or a plain coffee?",))),
        ("I've been {diet} for about two years now and feel great.", "Since going {diet}, my energy is way better.",
         "Cooking is tricky sometimes because I'm {diet}."),
        ("That takes commitment! Do you have favorite recipes?", "Good for you, it sounds like it's working.",
         "There are lots of great options these days."),
        ("What diet do I follow?", "Am I on a special diet?", "How do I eat these days?"),
        ("My aunt is cooking for me this weekend. What should I tell her about my meals?",),
        "what diet I'm on", "{diet}",
        ("My roommate just went {alt_diet}.", "{other} has been {alt_diet} since college."),
    ),
    FactKind(
        "hobby",
        tuple(_v(hobby=h) for h in ["rock climbing", "pottery", "birdwatching", "salsa dancing", "watercolor painting",
                                   "baking sourdough", "chess", "woodworking"]),
        ("I signed up for {hobby} classes and I'm completely hooked.", "My new thing is {hobby}, I did it three times this week.",
         "I spent the whole afternoon on {hobby} again, it's so relaxing."),
        ("That sounds like a lovely way to unwind.", "Amazing, new hobbies are so good for the mind.",
         "Ooh, you'll have to show me what you make!"),
        ("What hobby did I pick up recently?", "What new activity did I start?", "Which class did I sign up for?"),
        ("I have a free Saturday afternoon. What could I do that I've been enjoying lately?",
         "What would be a thoughtful gift for me related to my new pastime?"),
        "which hobby I took up", "{hobby}",
        ("My brother keeps telling me to try {alt_hobby}.", "{other} has been into {alt_hobby} for years."),
    ),
    FactKind(
        "wedding",
        tuple(_v(sib=s, month=m) for s, m in [("sister", "June"), ("brother", "September"), ("sister", "October"),
                                             ("brother", "July"), ("sister", "May")]),
        ("My {sib} {sname} is getting married in {month}, and I'm in the wedding party!",
         "{sname} finally set a date: my {sib} is getting married in {month}."),
        ("Congratulations to your family!", "How lovely, weddings are such fun.", "That's wonderful news!"),
        ("When is my {sib}'s wedding?", "Who in my family is getting married?"),
        ("By which month do I need my formal outfit ready for the family celebration?",
         "When should I block time off for the big family ceremony?"),
        "when my {sib}'s wedding is", "my {sib} {sname}, in {month}",
        ("My coworker {other} is getting married in {alt_month}.", "I went to a friend's wedding last year and cried the whole time."),
    ),
    FactKind(
        "child",
        tuple(_v(kid=k, age=a) for k, a in [("daughter", 5), ("son", 7), ("daughter", 9), ("son", 4), ("daughter", 11),
                                           ("son", 12)]),
        ("My {kid} {kname} just turned {age}, we had a party with a bouncy castle.",
         "Can't believe {kname} is {age} already. My {kid} grows up so fast."),
        ("Happy birthday to {kname}!", "Time flies! Sounds like a great party.", "Aww, what a sweet milestone."),
        ("How old is my {kid}?", "How old is {kname} now?"),
        ("How many candles will I need for the next birthday cake at home?",
         "Which age group should I look at when buying board games for my kid?"),
        "how old my {kid} is", "{age}",
        ("My neighbor's {alt_kid} just turned {alt_age}.", "{other}'s kids are starting a new school this fall."),
    ),
    FactKind(
        "language",
        tuple(_v(lang=lang) for lang in ["Spanish", "Japanese", "Italian", "Korean", "German", "Portuguese"]),
        ("I started learning {lang} with an app every morning.", "My {lang} lessons are going well, I can order food now!"),
        ("That's impressive, keep it up!", "Learning a language is such a great challenge.",
         "Nice! Daily practice really pays off."),
        ("Which language am I learning?", "What language did I start studying?"),
        ("Which country's podcasts would help me with my studies?",
         "What should I add as a second keyboard on my phone for practicing?"),
        "which language I'm learning", "{lang}",
        ("{other} speaks fluent {alt_lang}, I'm so jealous.", "I heard {alt_lang} is really hard for beginners."),
    ),
    FactKind(
        "injury",
        (_v(injury="broke my wrist", how="skiing", far=("Why might typing and chopping vegetables be hard for me right now?",)),
         _v(injury="sprained my ankle", how="playing basketball", far=("Should I join my friends on their long hike this weekend?",)),
         _v(injury="pulled a muscle in my back", how="moving furniture", far=("Is it a good idea for me to help my friend carry boxes on moving day?",)),
         _v(injury="hurt my knee", how="on a run", far=("Can I sign up for the stair-climbing charity race next week?",))),
        ("I {injury} {how} last week, so I'm taking it easy.", "Quick update: I {injury} {how}. Doctor says rest for a month."),
        ("Ouch! I hope you heal quickly.", "Take care of yourself and don't rush the recovery.", "Oh no, that sounds painful."),
        ("What injury did I have?", "How did I get hurt recently?"),
        ("Is there any reason I should skip my usual workout right now?",),
        "how I got hurt", "{injury} {how}",
        ("My friend {other} had a bad sports injury last year and it took ages to heal.",),
    ),
    FactKind(
        "team",
        tuple(_v(team=t) for t in ["the Boston Celtics", "Arsenal", "the Chicago Cubs", "FC Barcelona",
                                   "the Green Bay Packers", "the Toronto Raptors"]),
        ("I'm a die-hard {team} fan, I never miss a game.", "Watching {team} lose last night ruined my whole evening."),
        ("Sports can be such a rollercoaster!", "Loyal fans are the best fans.", "There's always next season!"),
        ("Which team do I support?", "Who do I root for in sports?"),
        ("Whose jersey would make a good birthday present for me?",),
        "which team I support", "{team}",
        ("My dad has been a {alt_team} fan his whole life.",),
    ),
    FactKind(
        "partner",
        tuple(_v(pjob=j) for j in ["firefighter", "graphic designer", "dentist", "journalist", "electrician", "pilot"]),
        ("My partner {pname} works as a {pjob}, so our schedules are chaotic.",
         "{pname}, my partner, just got promoted. Being a {pjob} is paying off!"),
        ("That's great to hear!", "Sounds like you two make a good team.", "Congrats to them!"),
        ("What's my partner's name?", "What does my partner do for a living?"),
        ("Who should I make the anniversary dinner reservation for, besides me?",),
        "my partner's name", "{pname}, a {pjob}",
        ("{other}'s husband works as a {alt_pjob}.",),
    ),
)

UPDATES: tuple[UpdateKind, ...] = (
    UpdateKind(
        "lesson",
        tuple(_v(inst=i) for i in ["piano", "guitar", "violin", "cello", "singing", "drum"]),
        ("I have {inst} lessons every {a} evening.", "My {inst} teacher only has {a} slots, so that's my lesson day."),
        ("I moved my {inst} lesson from {a} to {b}.", "Heads up: {inst} lessons are on {b} now instead of {a}."),
        ("Music is such a good outlet.", "Got it, thanks for the update!", "Nice, consistency is key."),
        ("What day is my {inst} lesson now?", "Which evening this week should I keep free for music class?"),
        "{b}",
        ("My nephew takes {inst} lessons on {c}s.",),
    ),
    UpdateKind(
        "home",
        (_v(),),
        ("I live in a tiny apartment in {a}, but I love the neighborhood.", "Living in {a} means I walk everywhere."),
        ("We finally moved! I now live in {b}, much closer to work.", "Goodbye {a}, hello {b}: the move is done!"),
        ("Moving is such a big deal, congrats!", "How are you finding the new place?", "That's a nice area."),
        ("Which city do I live in now?", "Where is home for me these days?"),
        "{b}",
        ("My friend {other} lives in {c}.",),
    ),
    UpdateKind(
        "car",
        (_v(),),
        ("I drive an old {a}; it's been reliable so far.", "My {a} needs new tires again."),
        ("I sold the {a} and bought a {b}!", "Traded in my {a} for a {b} yesterday, love it."),
        ("Cars are such a big purchase!", "Nice, enjoy the ride.", "Good choice!"),
        ("What car do I drive now?", "Which vehicle should I list when I renew my parking permit?"),
        "{b}",
        ("My dad just bought a {c}.",),
    ),
    UpdateKind(
        "gym",
        (_v(),),
        ("I hit the gym every day at {a}.", "My workout slot is {a}, before everything else."),
        ("I switched my workouts to {b}, the old time was too hard.", "No more {a} gym sessions, I go at {b} now."),
        ("Exercise is so good for you.", "Whatever time works is the best time!", "Good call."),
        ("What time do I work out these days?", "When should I avoid scheduling calls because I'm exercising?"),
        "{b}",
        ("{other} goes to the gym at {c}, which sounds brutal.",),
    ),
    UpdateKind(
        "manager",
        (_v(),),
        ("My manager {a} is pretty supportive.", "Had a one-on-one with my manager {a} today."),
        ("{a} left the company, so {b} is my new manager.", "Reorg at work: I report to {b} now, not {a}."),
        ("Changes at work can be stressful.", "I hope the new setup works out.", "Fingers crossed!"),
        ("Who is my manager now?", "Who do I need to ask to approve my days off?"),
        "{b}",
        ("{c} from accounting is a manager too.",),
    ),
    UpdateKind(
        "show",
        (_v(),),
        ("I'm totally hooked on {a} right now.", "Watched three episodes of {a} last night."),
        ("I gave up on {a}; now I'm binge-watching {b}.", "Switched from {a} to {b}, way better."),
        ("Ooh, good taste!", "There's so much good TV these days.", "Haha, binge-watching is the best."),
        ("Which series am I watching these days?", "What show should we talk about if I want to chat about what I'm watching?"),
        "{b}",
        ("Everyone at work is talking about {c}.",),
    ),
)

# Value pools for the update kinds: {a} old, {b} new, {c} distractor.
_UPDATE_POOLS = {
    "lesson": DAYS,
    "home": ["Denver", "Austin", "Portland", "Boston", "Chicago", "Seattle", "Atlanta", "Minneapolis"],
    "car": ["Honda Civic", "Toyota Corolla", "Subaru Outback", "Ford Focus", "Mazda 3", "Tesla Model 3",
            "Volkswagen Golf", "Kia Niro"],
    "gym": ["6 am", "7 am", "noon", "5 pm", "6:30 pm", "8 pm"],
    "manager": OTHER_NAMES,
    "show": ["The Bear", "Severance", "Succession", "Ted Lasso", "The Crown", "Stranger Things", "Abbott Elementary",
             "The Last of Us"],
}

MULTI = (
    "Can you remind me of {c1} and also {c2}?",
    "Two things I forgot: {c1}, and {c2}. What were they?",
    "Quick check before my appointment: {c1} and {c2}?",
)
# Compositions that need two facts (kind1, kind2, template using both kinds' fields).
COMPOSED = (
    ("pet", "trip", "Who will need a sitter while I'm in {city}?"),
    ("allergy", "wedding", "Is there anything I should watch out for, health-wise, at my {sib}'s wedding?"),
    ("diet", "trip", "What kind of restaurants should I look up for my trip in {month}?"),
    ("injury", "hobby", "Will my recent injury keep me from my new hobby for a while?"),
    ("child", "pet", "Is {kname} old enough to take care of our pet alone?"),
)

FILLER: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "weather": (("It's been raining nonstop here for {n} days.", "Finally some sunshine today, I went for a walk.",
                 "So windy this morning that my umbrella flipped inside out.", "It's way too hot, I'm melting.",
                 "First frost of the season today, I had to scrape the windshield.", "The fog was so thick I could barely see the street."),
                ("Sounds like perfect weather for a cozy day inside.", "Hopefully it clears up soon!",
                 "Stay dry out there!", "Nice, a bit of sun makes everything better.")),
    "tv": (("I started watching a baking competition show, it's weirdly addictive.", "Did you see the finale of that detective series? Wild.",
            "I fell asleep in front of a nature documentary again.", "There's nothing good on TV tonight.",
            "I rewatched an old sitcom from the nineties, still funny."),
           ("Ha, those shows are hard to stop watching!", "No spoilers please!", "Documentaries are great for relaxing.",
            "Sometimes a comfort rewatch is exactly what you need.")),
    "weekend": (("This weekend I mostly cleaned the apartment and did laundry.", "We went to a farmers market on Saturday, lots of fresh bread.",
                 "I slept in until ten on Sunday, felt amazing.", "Spent the weekend helping a friend paint her living room.",
                 "We had a game night with friends, I lost at every game.", "I went to a flea market and bought a weird old lamp."),
                ("That sounds like a productive weekend.", "Sounds relaxing!", "Haha, game nights are the best even when you lose.",
                 "Nice, a slow weekend is underrated.")),
    "food": (("I tried a new ramen place downtown, the broth was incredible.", "Made soup for the whole week yesterday.",
              "I'm trying to drink more water, it's harder than it sounds.", "Had the best croissant of my life this morning.",
              "Coffee machine broke, so I'm surviving on tea today."),
             ("Yum, that sounds delicious.", "Meal prep is such a time saver!", "Oh no, a day without coffee is tough.",
              "Good habit! A water bottle on the desk helps.")),
    "work": (("Long day, back-to-back meetings from nine to five.", "My commute took forever because of roadworks.",
              "The printer at work jammed again, classic Monday.", "Finally cleared my inbox today, feeling accomplished.",
              "We had a team lunch today, it was nice to chat outside the office."),
             ("That sounds exhausting, hope you can rest tonight.", "Roadworks are the worst.", "Inbox zero is a great feeling!",
              "Team lunches are good for morale.")),
    "misc": (("I've been reading a mystery novel before bed.", "Our neighbors are renovating and the drilling starts at 8 am.",
              "I finally fixed the squeaky door, so satisfying.", "I've been trying to go to bed earlier this week.",
              "My phone screen cracked when it fell off the couch.", "I reorganized my bookshelf by color, looks great.",
              "Went for a long walk by the river this evening."),
             ("Good books make the best bedtime routine.", "Ugh, construction noise is so annoying.", "Small wins count!",
              "Sleep makes such a difference.", "Oh no! Hopefully it's covered by warranty.", "That sounds peaceful.")),
}
GREETINGS = ("Hey, good {part}! How's it going?", "Hi again! It's been a while.", "Hello! I'm back, got a minute?",
             "Morning! Ready for another chat?", "Hey there, hope you're doing well.", "Hi! Quick chat before I head out?")
GREET_REPLIES = ("Hi {name}! Great to hear from you. What's new?", "Hey {name}, always happy to chat. How are you?",
                 "Hello {name}! What's on your mind today?", "Good to see you, {name}! Tell me everything.")
SMALL_REPLIES = ("That's interesting, tell me more.", "I hear you.", "Ha, I know that feeling.", "Sounds like quite a day!")


@dataclass
class _Fact:
    """A placed fact: its turn, the session index and the fields it was rendered with."""

    kind: str
    fields: dict
    turn_id: str
    session: int
    text: str


def _fill(template: str, fields: dict) -> str:
    return template.format(**fields)


def _fact_fields(kind: FactKind, value: dict, rng: random.Random, persona: dict) -> dict:
    """Template fields of one fact: its value, the persona's names, ``alt_*`` from another value."""
    fields = dict(persona)
    fields.update((k, v) for k, v in value.items() if k != "far")
    fields.update(sname=persona[fields.get("sib", "sister")], kname=persona[fields.get("kid", "daughter")])
    alt = rng.choice([v for v in kind.values if v is not value] or [value])
    fields.update((f"alt_{k}", v) for k, v in alt.items() if k != "far")
    return fields


def _place_slots(rng: random.Random, sessions: int, turns: int, per_session: int) -> list[tuple[int, int]]:
    """(session, turn position) of fact slots, in time order. User turns are at even positions."""
    slots = []
    for s in range(sessions):
        user_pos = list(range(0, turns, 2))
        if len(user_pos) > per_session:
            user_pos = user_pos[1:]           # keep the first user turn for a greeting
        slots += [(s, p) for p in sorted(rng.sample(user_pos, min(per_session, len(user_pos))))]
    return slots


def _pick_update_pairs(rng: random.Random, slots: list, n_pairs: int) -> list[tuple[int, int]]:
    """Indices (old, new) into ``slots``, new strictly later (in a later session if possible)."""
    free = list(range(len(slots)))
    pairs = []
    for _ in range(n_pairs):
        cands = [(i, j) for i in free for j in free if slots[j][0] > slots[i][0]] or \
                [(i, j) for i in free for j in free if j > i]
        if not cands:
            break
        i, j = rng.choice(cands)
        pairs.append((i, j))
        free.remove(i)
        free.remove(j)
    return pairs


def _dates(rng: random.Random, sessions: int, start: _dt.date) -> tuple[list[_dt.date], list[int]]:
    """Session dates 3-14 days apart and each session's gap to the next (7 after the last)."""
    dates, d = [], start + _dt.timedelta(days=rng.randint(0, 60))
    for _ in range(sessions):
        dates.append(d)
        d = d + _dt.timedelta(days=rng.randint(3, 14))
    gaps = [(dates[i + 1] - dates[i]).days for i in range(sessions - 1)] + [7]
    return dates, gaps


def _tid(s: int, p: int) -> str:
    """LoCoMo-style turn id ("D<session>:<turn>", 1-based)."""
    return f"D{s + 1}:{p + 1}"


def _place_facts(rng: random.Random, slots: list, persona: dict, pool: list[str]):
    """Decide what each fact slot says.

    Returns ``said`` {(session, pos): (user text, assistant reply)}, the simple facts by
    kind name, and the update facts as (kind, fields, latest fact).
    """
    pairs = _pick_update_pairs(rng, slots, min(len(UPDATES), round(len(slots) * 0.2)))
    paired = {i for pair in pairs for i in pair}
    simple_slots = [i for i in range(len(slots)) if i not in paired]
    said: dict[tuple[int, int], tuple[str, str]] = {}
    facts: dict[str, _Fact] = {}
    for i, kind in zip(simple_slots, rng.sample(FACTS, len(FACTS))):
        s, p = slots[i]
        value = rng.choice(kind.values)
        fields = _fact_fields(kind, value, rng, persona)
        said[(s, p)] = (_fill(rng.choice(kind.statements), fields), _fill(rng.choice(kind.replies), fields))
        facts[kind.name] = _Fact(kind.name, dict(fields, far=value.get("far", ())), _tid(s, p), s, said[(s, p)][0])
    updates: list[tuple[UpdateKind, dict, _Fact]] = []
    for (i, j), kind in zip(pairs, rng.sample(UPDATES, len(UPDATES))):
        values = _UPDATE_POOLS[kind.name] if kind.name != "manager" else pool
        a, b, c = rng.sample(values, 3)
        fields = dict(rng.choice(kind.values), a=a, b=b, c=c, other=rng.choice(pool))
        for k, templates in ((i, kind.old), (j, kind.new)):
            said[slots[k]] = (_fill(rng.choice(templates), fields), _fill(rng.choice(kind.replies), fields))
        s, p = slots[j]
        updates.append((kind, fields, _Fact(kind.name, fields, _tid(s, p), s, said[(s, p)][0])))
    return said, facts, updates


def _distractors(rng: random.Random, facts: dict[str, "_Fact"], updates, pool: list[str]) -> list[str]:
    """Near-miss statements about other people, for the kinds this user has facts of."""
    kinds = {k.name: k for k in FACTS}
    out = [_fill(t, dict(f.fields, other=rng.choice(pool))) for f in facts.values() for t in kinds[f.kind].distractors]
    return out + [_fill(t, fields) for kind, fields, _ in updates for t in kind.distractors]


def _small_talk(rng: random.Random, p: int, name: str, distractors: list[str], rate: float) -> tuple[str, str]:
    """A (user text, assistant reply) pair that states no fact about the user."""
    if p == 0:
        return (rng.choice(GREETINGS).format(part=rng.choice(["morning", "afternoon", "evening"])),
                rng.choice(GREET_REPLIES).format(name=name))
    if distractors and rng.random() < rate:
        return rng.choice(distractors), rng.choice(SMALL_REPLIES)
    said, replies = FILLER[rng.choice(sorted(FILLER))]
    return rng.choice(said).format(n=rng.randint(2, 9)), rng.choice(replies)


def _make_user(u: int, seed: int, sessions: int, turns: int, facts_per_session: int,
               distractor_rate: float, start: _dt.date) -> User:
    """One user: persona, sessions with facts among small talk, and the questions."""
    rng = random.Random(f"rmm-synthetic:{seed}:{u}")
    name = USER_NAMES[u] if u < len(USER_NAMES) else f"{rng.choice(USER_NAMES)} {u}"
    women, men = rng.sample(FEMALE_NAMES, 2), rng.sample(MALE_NAMES, 2)
    persona = dict(sister=women[0], daughter=women[1], brother=men[0], son=men[1], pname=rng.choice(OTHER_NAMES))
    pool = [n for n in OTHER_NAMES if n not in persona.values()]
    dates, gaps = _dates(rng, sessions, start)
    slots = _place_slots(rng, sessions, turns, facts_per_session)
    said, facts, updates = _place_facts(rng, slots, persona, pool)
    distractors = _distractors(rng, facts, updates, pool)
    session_objs = []
    for s in range(sessions):
        sid, ts = f"session_{s + 1}", dates[s].isoformat()
        out: list[Turn] = []
        for p in range(0, turns, 2):
            text, reply = said.get((s, p)) or _small_talk(rng, p, name, distractors, distractor_rate)
            out.append(Turn(_tid(s, p), sid, name, f"{name}: {text}", ts))
            if p + 1 < turns:
                out.append(Turn(_tid(s, p + 1), sid, ASSISTANT, f"{ASSISTANT}: {reply}", ts))
        session_objs.append(Session(sid, ts, tuple(out)))
    return User(f"user{u}", tuple(session_objs), _queries(rng, facts, updates, sessions, dates, gaps))


def _ask_date(rng: random.Random, after: int, sessions: int, dates, gaps) -> str:
    """A date strictly after session ``after`` and before the next session after it."""
    k = rng.randint(after, sessions - 1)
    return (dates[k] + _dt.timedelta(days=rng.randint(1, max(1, gaps[k] - 1)))).isoformat()


def _queries(rng: random.Random, facts: dict[str, _Fact], upd, sessions: int, dates, gaps) -> tuple[Query, ...]:
    """Questions about the placed facts, ordered by date; ids ``q0, q1, ...``."""
    kinds = {k.name: k for k in FACTS}
    raw: list[tuple[str, str, tuple[str, ...], str, int]] = []   # text, category, gold, answer, after
    for f in facts.values():
        kind = kinds[f.kind]
        ans = _fill(kind.answer, f.fields)
        raw.append((_fill(rng.choice(kind.close), f.fields), "single-hop", (f.turn_id,), ans, f.session))
        far = list(f.fields.get("far", ())) + list(kind.far)
        raw.append((_fill(rng.choice(far), f.fields), "paraphrase", (f.turn_id,), ans, f.session))
    for kind, fields, f in upd:
        raw.append((_fill(rng.choice(kind.questions), fields), "update", (f.turn_id,),
                    _fill(kind.answer, fields), f.session))
    n_multi = min(max(1, sessions // 2), len(facts) * (len(facts) - 1) // 2)
    composed = [c for c in COMPOSED if c[0] in facts and c[1] in facts]
    rng.shuffle(composed)
    pairs_done: set[frozenset] = set()
    for k1, k2, tmpl in composed[:n_multi]:
        f1, f2 = facts[k1], facts[k2]
        raw.append((_fill(tmpl, {**f2.fields, **f1.fields}), "multi-hop", (f1.turn_id, f2.turn_id),
                    f"{_fill(kinds[k1].answer, f1.fields)}; {_fill(kinds[k2].answer, f2.fields)}",
                    max(f1.session, f2.session)))
        pairs_done.add(frozenset((k1, k2)))
    names = sorted(facts)
    while len(pairs_done) < n_multi:
        k1, k2 = rng.sample(names, 2)
        if frozenset((k1, k2)) in pairs_done:
            continue
        pairs_done.add(frozenset((k1, k2)))
        f1, f2 = facts[k1], facts[k2]
        text = rng.choice(MULTI).format(c1=_fill(kinds[k1].clause, f1.fields), c2=_fill(kinds[k2].clause, f2.fields))
        raw.append((text, "multi-hop", (f1.turn_id, f2.turn_id),
                    f"{_fill(kinds[k1].answer, f1.fields)}; {_fill(kinds[k2].answer, f2.fields)}",
                    max(f1.session, f2.session)))
    dated = sorted((_ask_date(rng, r[4], sessions, dates, gaps), n) for n, r in enumerate(raw))
    return tuple(Query(f"q{i}", raw[n][0], raw[n][2], category=raw[n][1], date=date, answer=raw[n][3])
                 for i, (date, n) in enumerate(dated))


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InputError(f"must be {want}, got {value!r}", where=name)
    return value


def make_synthetic(users: int = 8, sessions: int = 6, turns: int = 10, seed: int = 0, *,
                   facts_per_session: int = 2, distractor_rate: float = 0.25,
                   start_date: str = "2023-03-01") -> Dataset:
    """The built-in demo dataset (see the module docstring); deterministic in ``seed``.

    ``turns`` counts both speakers (user turns at even positions, each followed by the
    assistant's reply); ``facts_per_session`` user turns per session state a fact, and a
    filler user turn is a near-miss distractor with probability ``distractor_rate``.
    With the defaults a user has about 3 questions per session.
    """
    _positive("users", users)
    _positive("sessions", sessions)
    _positive("turns", turns)
    _positive("seed", seed, minimum=0)
    _positive("facts_per_session", facts_per_session, minimum=0)
    if not (isinstance(distractor_rate, (int, float)) and 0.0 <= distractor_rate <= 1.0):
        raise InputError(f"must be a number in [0, 1], got {distractor_rate!r}", where="distractor_rate")
    try:
        start = _dt.date.fromisoformat(start_date)
    except (TypeError, ValueError):
        raise InputError(f"must be an ISO date YYYY-MM-DD, got {start_date!r}", where="start_date") from None
    out = tuple(_make_user(u, seed, sessions, turns, facts_per_session, distractor_rate, start) for u in range(users))
    per_cat = Counter(q.category for u in out for q in u.queries)
    stats = {"questions": sum(per_cat.values()), "per_category": dict(sorted(per_cat.items())),
             "skipped_unresolved": 0, "seed": seed}
    return Dataset("synthetic", out, stats)


SPEC_KEYS = ("users", "sessions", "turns", "seed")


def parse_synthetic_spec(spec: str) -> dict:
    """``"users=4,sessions=3,turns=8,seed=1"`` -> ``{"users": 4, ...}`` (any subset, any order).

    Unknown keys, repeated keys, malformed items and non-positive sizes (or a negative
    seed) raise InputError naming the item.
    """
    out: dict[str, int] = {}
    for item in (p.strip() for p in spec.split(",")):
        if not item:
            continue
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise InputError(f"expected key=value, got {item!r}", where=f"synthetic spec {spec!r}")
        if key not in SPEC_KEYS:
            raise InputError(f"unknown key {key!r} (known: {', '.join(SPEC_KEYS)})", where=f"synthetic spec {spec!r}")
        if key in out:
            raise InputError(f"key {key!r} given twice", where=f"synthetic spec {spec!r}")
        try:
            number = int(value)
        except ValueError:
            raise InputError(f"{key} must be an integer, got {value!r}", where=f"synthetic spec {spec!r}") from None
        if number < (0 if key == "seed" else 1):
            want = "non-negative" if key == "seed" else "positive"
            raise InputError(f"{key} must be {want}, got {value!r}", where=f"synthetic spec {spec!r}")
        out[key] = number
    return out
