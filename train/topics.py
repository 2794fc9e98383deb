"""Questions about the world, for the head's training: topics by field, asked through a few question forms.

ShareGPT, the training prompts' source, is mostly code, business and writing requests: of its 10.9k training
conversations only ~250 open with a science or humanities question, and the shipped head accepts 0.47 of its
first drafts on MT-bench's STEM and humanities prompts against 0.62-0.69 on the other six categories. UltraChat
(EAGLE's second source) filled that gap for the papers by asking a chat model about topics drawn from lists;
these lists, written for this project, do the same for our target's own replies. None of the eighty held-out
MT-bench-style prompts' subjects is a topic here (tests/test_train.py checks the words).
"""
from __future__ import annotations

TOPICS = {
    "physics": [
        "Newton's three laws of motion", "friction", "the conservation of momentum", "kinetic and potential energy",
        "how a lever works", "buoyancy and Archimedes' principle", "sound waves", "the Doppler effect",
        "refraction of light", "how lenses focus light", "static electricity", "electric current and resistance",
        "how an electric motor works", "electromagnetic induction", "the speed of light", "radioactive decay",
        "nuclear fission", "nuclear fusion in the Sun", "the theory of relativity", "quantum tunnelling",
        "heat conduction, convection and radiation", "the three states of matter", "pressure in fluids",
        "centripetal force", "terminal velocity", "magnetism and magnetic fields", "semiconductors", "lasers",
    ],
    "chemistry": [
        "the periodic table", "ionic and covalent bonds", "acids and bases", "the pH scale", "oxidation and rust",
        "chemical equilibrium", "catalysts", "the mole in chemistry", "isotopes", "exothermic reactions",
        "polymers and plastics", "how soap removes grease", "combustion", "electrolysis", "noble gases",
        "organic chemistry", "hydrogen bonds", "how salt dissolves in water", "crystals", "alloys such as steel",
        "fermentation", "the chemistry of baking bread", "distillation", "carbon dating",
    ],
    "biology": [
        "the structure of a cell", "mitosis and meiosis", "natural selection", "how enzymes work",
        "the human heart", "how the lungs exchange gases", "the nervous system", "hormones", "the digestive system",
        "the kidneys", "cellular respiration", "mitochondria", "how muscles contract", "blood types",
        "the skeleton", "genetic mutations", "inheritance and Mendel's peas", "stem cells", "the microbiome",
        "how plants take up water", "pollination", "animal migration", "hibernation", "camouflage in animals",
        "how bees communicate", "fungi", "coral reefs", "the life cycle of a butterfly", "symbiosis",
    ],
    "earth science": [
        "plate tectonics", "how volcanoes form", "earthquakes and the Richter scale", "the rock cycle",
        "how mountains form", "glaciers", "erosion", "the water cycle", "ocean currents", "tides",
        "hurricanes", "tornadoes", "lightning", "the layers of the atmosphere", "the ozone layer", "deserts",
        "rainforests", "how caves form", "fossils", "groundwater", "monsoons", "El Nino", "tsunamis",
    ],
    "astronomy": [
        "the life cycle of a star", "black holes", "the Big Bang", "how the Moon formed", "phases of the Moon",
        "solar eclipses", "comets and asteroids", "the planets of the solar system", "Jupiter's moons",
        "Saturn's rings", "Mars", "exoplanets", "galaxies", "the Milky Way", "light-years", "neutron stars",
        "the Hubble Space Telescope", "how rockets reach orbit", "the International Space Station",
        "dark matter", "meteor showers", "the Apollo Moon landings",
    ],
    "health and medicine": [
        "antibiotics", "antibiotic resistance", "how the body fights a fever", "sleep and why we need it",
        "vitamins", "a balanced diet", "blood pressure", "diabetes", "how anaesthesia works", "allergies",
        "the placebo effect", "X-rays", "MRI scans", "how wounds heal", "cholesterol", "dehydration",
        "the benefits of exercise", "hand washing and hygiene", "clinical trials", "the history of penicillin",
        "how the eye sees colour", "how hearing works",
    ],
    "technology": [
        "how the internet works", "how a search engine works", "how GPS finds your position", "how Wi-Fi works",
        "how solar panels make electricity", "wind turbines", "how a microwave oven heats food",
        "the transistor", "how a touchscreen works", "electric cars", "3D printing", "how a jet engine works",
        "bridges and how they carry loads", "the steam engine", "the telephone", "radio", "television",
        "how computers store data", "encryption", "cloud computing", "robots in factories", "nuclear power plants",
        "hydroelectric dams", "recycling",
    ],
    "mathematics": [
        "prime numbers", "the Pythagorean theorem", "the number pi", "triangles and their angles", "fractions and decimals",
        "negative numbers", "the binary number system", "the golden ratio", "statistics and averages",
        "exponential growth", "logarithms", "the concept of infinity", "geometry of circles", "symmetry",
        "graphs and functions", "the history of zero", "percentages", "compound interest", "calculus",
    ],
    "environment": [
        "carbon footprints", "the greenhouse effect", "renewable energy", "deforestation", "biodiversity",
        "endangered species", "ocean acidification", "plastic pollution", "air pollution", "acid rain",
        "the carbon cycle", "sustainable farming", "composting", "wetlands", "overfishing", "invasive species",
        "national parks", "urban heat islands",
    ],
    "world history": [
        "the fall of the Roman Empire", "the Roman Republic", "ancient Greek city-states", "the Persian Empire",
        "the Mongol Empire", "the Ottoman Empire", "feudalism in medieval Europe", "the Black Death",
        "the Crusades", "the Age of Exploration", "the Reformation", "the Scientific Revolution",
        "the American Revolution", "the abolition of slavery", "the unification of Germany", "World War I",
        "World War II", "the Cold War", "the fall of the Berlin Wall", "decolonisation in Africa",
        "the Meiji Restoration in Japan", "the Inca Empire", "the Aztec Empire", "the Maya civilization",
        "the Viking Age", "the Magna Carta", "the Russian Revolution", "the Great Depression",
        "the civil rights movement", "the founding of the United Nations", "the Han dynasty",
        "the Great Wall of China", "the Mughal Empire", "ancient Mesopotamia", "the Hundred Years' War",
    ],
    "philosophy": [
        "Socrates and the Socratic method", "Stoicism", "Confucius", "Buddhist philosophy", "utilitarianism",
        "Kant's categorical imperative", "existentialism", "the social contract", "free will",
        "the trolley problem", "Descartes' 'I think, therefore I am'", "empiricism and rationalism",
        "John Locke's ideas", "Nietzsche", "the philosophy of science", "logic and fallacies", "virtue ethics",
        "the meaning of justice", "Taoism", "the problem of evil",
    ],
    "religion and mythology": [
        "Greek mythology", "Norse mythology", "the origins of Buddhism", "Hinduism", "the spread of Islam",
        "the history of Christianity", "Judaism", "Shinto", "Sikhism", "religious festivals around the world",
        "Celtic mythology", "Roman gods", "creation myths", "pilgrimages",
    ],
    "literature": [
        "Shakespeare's tragedies", "the Odyssey", "the Iliad", "Don Quixote", "Romanticism in literature",
        "the novel as a form", "poetry and metre", "the sonnet", "Greek tragedy", "fairy tales",
        "science fiction", "Jane Austen's novels", "Dante's Divine Comedy", "Tolstoy", "haiku", "satire",
        "the epic of Gilgamesh", "magical realism", "gothic novels", "the hero's journey",
    ],
    "art and music": [
        "Impressionism", "the Baroque period", "Cubism", "Gothic architecture", "ancient Greek sculpture",
        "Leonardo da Vinci", "Vincent van Gogh", "the symphony", "Beethoven", "Mozart", "jazz", "the blues",
        "opera", "classical ballet", "photography as art", "perspective in painting", "Japanese woodblock prints",
        "the history of the piano", "folk music", "abstract art", "Islamic geometric art",
    ],
    "economics": [
        "inflation", "interest rates", "central banks", "taxes", "the stock market", "unemployment",
        "gross domestic product", "free trade", "tariffs", "globalisation", "opportunity cost", "monopolies",
        "the history of money", "budgets and saving", "recessions", "the gig economy", "cryptocurrencies",
        "minimum wage debates", "scarcity",
    ],
    "government and law": [
        "the separation of powers", "federalism", "elections and voting systems", "human rights",
        "the rule of law", "how a bill becomes law", "the role of courts", "constitutions", "parliaments",
        "citizenship", "freedom of speech", "international law", "the European Union", "political parties",
        "jury trials", "local government",
    ],
    "society and psychology": [
        "memory and how we forget", "motivation", "cognitive biases", "how children learn language",
        "emotional intelligence", "stress", "habits", "urbanisation", "migration", "the family across cultures",
        "education systems", "social media's effects", "the scientific method in psychology", "conformity",
        "leadership", "teamwork", "culture shock", "public health campaigns",
    ],
    "geography and cultures": [
        "the Amazon River", "the Himalayas", "the Sahara", "Antarctica", "the Great Barrier Reef",
        "the Mediterranean Sea", "Japanese tea ceremonies", "Indian cuisine", "Mexican Day of the Dead",
        "Chinese New Year", "the Olympic Games", "Scandinavian countries", "the Andes", "islands of the Pacific",
        "world languages", "time zones", "maps and map projections", "the history of cities",
    ],
}

QUESTIONS = [
    "Explain {} in simple terms.",
    "What is the most important thing to know about {}?",
    "Give a short overview of {}.",
    "How would you explain {} to a twelve-year-old?",
    "What are the key facts a student should know about {}?",
    "Write a short encyclopedia paragraph about {}.",
    "What are common misconceptions about {}?",
    "Describe {} and give one real-world example.",
    "List three important points about {} and explain each.",
    "Why do people study {}?",
]


def world_questions(n: int | None = None) -> list[str]:
    """Every (topic, question form) pair as a prompt, in an order that mixes fields and forms: the i-th
    round asks each field's i-th topic in turn, each topic's forms rotating with its place. n: the first n."""
    fields = list(TOPICS.values())
    prompts = []
    for form in range(len(QUESTIONS)):
        for i in range(max(len(ts) for ts in fields)):
            for f, ts in enumerate(fields):
                if i < len(ts):
                    prompts.append(QUESTIONS[(form + i + f) % len(QUESTIONS)].format(ts[i]))
    return prompts if n is None else prompts[:n]
