"""The tokenizer's training text: varied everyday and operations English.

A model trained on nothing would still tokenize, but byte by byte, which makes
token counts unrealistic; these lines give the BPE merges for common words.
"""

from __future__ import annotations

__all__ = ["training_lines"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog.
Hello! How can I help you today?
Thank you for your patience while we look into this.
Our service is currently under maintenance. Please try again in a few minutes.
The assistant answers questions about orders, billing, shipping and returns.
You can reset your password from the account settings page.
If you did not receive the email, check your spam folder first.
Refunds are usually processed within five to seven business days.
We ship to most countries in Europe, North America and Asia.
The package left our warehouse on Monday morning and should arrive on Thursday.
Please share your order number so that I can check the status.
I am sorry, but I could not find an order with that number.
Would you like me to connect you with a human agent?
The weather today is sunny with a light breeze from the west.
It rained all night, and the streets were still wet in the morning.
She opened the window and listened to the birds singing in the garden.
He walked to the station, bought a ticket and waited for the train.
The train was late because of a signal failure near the bridge.
They decided to have dinner at the small restaurant around the corner.
The soup was hot, the bread was fresh, and the coffee was strong.
A good answer is short, clear and correct.
Write a summary of the document in three sentences.
Translate the following sentence into French.
Explain the difference between a process and a thread.
A process has its own memory; threads inside a process share memory.
The server accepts requests over HTTP and returns JSON responses.
When the queue is full, new requests wait or receive an error.
The load balancer sends traffic to the healthy instances only.
A circuit breaker opens after several failures and closes again after a pause.
Latency is the time between a request and its response.
Throughput is the number of requests handled per second.
The first token arrived after two hundred milliseconds.
Memory usage grew slowly until the process was restarted.
The engine ran out of memory and had to be restarted.
We switched to the backup server while the main one recovered.
Monitoring shows the error rate, the latency and the queue length.
An alert fires when the latency stays above the threshold for five minutes.
The operator checked the dashboard and saw that everything was green again.
Configuration files are written in YAML and reloaded without a restart.
A bad configuration is rejected, and the previous one stays active.
The model generates text one token at a time.
Each token is a small piece of a word, a whole word or a punctuation mark.
The context window limits how much text the model can read at once.
Old messages are dropped when the conversation grows too long.
The system prompt tells the assistant how to behave.
The user asked a question, and the assistant answered politely.
Streaming responses let the user see the answer as it is written.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many texts.
The meeting starts at 9:30 and ends at 11:00.
The price is 19.99 dollars, including taxes and shipping.
Call us at any time; our support team is available day and night.
Open the file, read each line, and count the words.
The function returns a list of numbers sorted from smallest to largest.
If the input is empty, the function returns an empty list.
Python, Rust, Go and JavaScript are popular programming languages.
A database stores data in tables made of rows and columns.
The cache keeps recent results in memory to answer faster.
Backups are taken every night and kept for thirty days.
The library is open from Monday to Saturday.
Children played football in the park until the sun went down.
The mountain was covered with snow, and the lake below was frozen.
We planted tomatoes, beans and potatoes in the spring.
The cat slept on the warm windowsill all afternoon.
My favourite books are about history, science and travel.
The museum has a large collection of paintings and old maps.
She studied medicine at the university and became a doctor.
He plays the piano every evening after work.
The city is famous for its bridges, markets and music.
The river flows through the valley towards the sea.
Winter is cold and dark, but summer days are long and bright.
Please keep your answer under one hundred words.
Can you give me an example?
Yes, of course. Here is a simple example.
No, that is not possible right now.
Let me think about that for a moment.
First, second, third, and finally, the last step.
This is important: always save your work before closing the program.
Good morning, good afternoon, good evening and good night.
What time is it? Where are you going? Why did it stop? Who called?
The answer depends on several factors, including cost and time.
In short, the new version is faster, smaller and easier to use.
The team fixed the bug, wrote a test and released a new version.
Users reported that the page loaded slowly during the evening peak.
The proxy limits the number of requests sent to the engine at the same time.
Requests that cannot be served quickly receive a polite message instead.
The frequently asked questions page explains how to change your plan.
You can cancel your subscription at any time without extra fees.
Your data is stored securely and never shared with third parties.
The weather forecast says there will be rain tomorrow afternoon.
The store closes early on public holidays.
We are happy to hear that the problem is solved.
Please describe the problem in as much detail as possible.
Restarting the application often fixes temporary errors.
The update will be installed automatically tonight.
Make sure that your device is connected to the internet.
The battery lasts about ten hours with normal use.
The screen is bright, the keyboard is quiet, and the laptop is light.
An apple, a banana, an orange and a handful of grapes.
Water boils at one hundred degrees Celsius at sea level.
The earth goes around the sun once a year.
Light travels faster than sound.
Cities grow when people move from the countryside to find work.
Music, art and stories help people share their feelings.
The old man told the children a story about a dragon and a brave girl.
Once upon a time, there was a small village at the edge of a forest.
Every morning the baker made bread, cakes and sweet rolls.
The teacher asked the students to write an essay about their summer.
A friendly dog followed us all the way home.
The hotel room was clean, quiet and comfortable.
We booked a table for four people at eight o'clock.
Could you please repeat the question?
I do not know the answer, but I can try to find out.
According to the report, sales increased by twelve percent last quarter.
The company hired new engineers to improve the product.
Safety comes first: wear a helmet when you ride a bicycle.
The doctor recommended rest, water and healthy food.
Exercise, sleep and good friends make people happier.
The road was closed, so we took a longer route through the hills.
Turn left at the traffic lights, then go straight for two hundred metres.
The airport is forty minutes from the city centre by bus.
Our flight was delayed because of strong winds.
The children built a sandcastle on the beach.
Stars filled the sky, and the moon rose above the trees.
He forgot his umbrella and got wet on the way to work.
She wrote a letter to her grandmother every week.
The garden looks beautiful when the roses are in bloom.
There are seven days in a week and twelve months in a year.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
January, February, March, April, May, June, July, August, September, October, November, December.
Spring, summer, autumn and winter each have their own colours.
The kitchen smelled of fresh coffee, warm bread and cinnamon.
He looked at the clock and realised that he was already late.
The bus was crowded, so she decided to walk instead.
The students listened carefully while the professor explained the theory.
The experiment failed twice before it finally worked.
Scientists measure temperature, pressure and speed with great care.
The history of the city goes back more than two thousand years.
The king and the queen lived in a castle on a hill above the town.
A small boat sailed slowly across the calm blue water.
The farmer feeds the animals early every morning.
Horses, cows, sheep and chickens live on the farm.
The forest is home to deer, foxes, owls and many kinds of insects.
We heard thunder in the distance and saw lightning over the hills.
The shop sells fruit, vegetables, cheese, milk and eggs.
Do you prefer tea or coffee in the morning?
I usually drink a glass of water before breakfast.
The recipe needs two eggs, a cup of flour and a little sugar.
Mix the ingredients, pour them into a pan and bake for thirty minutes.
The film was long, but the ending was surprising and moving.
The audience clapped loudly when the concert ended.
The newspaper published an article about the new hospital.
The government announced a plan to build more schools and roads.
Prices went up last year, and many families had to save money.
The bank opens at nine and closes at five on weekdays.
Please sign the form and return it before the end of the month.
Your account has been updated successfully.
Something went wrong. Please try again later.
The request timed out because the server did not respond in time.
The connection was refused, so the client tried another address.
Too many requests were sent in a short time; please slow down.
The service is temporarily unavailable due to high demand.
We are working on a fix and will update this page soon.
All systems are operating normally.
The status page shows the current state of every component.
Engineers deploy new versions gradually to a small share of users first.
If errors increase, the deployment is rolled back automatically.
The health check returns success when the service is ready.
Logs, metrics and traces help engineers understand what happened.
The graph shows that the response time doubled during the incident.
After the incident, the team wrote a report and listed the lessons learned.
A good design keeps each part small, simple and easy to test.
Tests check that the code behaves as expected.
The documentation explains how to install, configure and run the program.
Run the command in a terminal and wait until it finishes.
The download finished, and the installation took about two minutes.
Open the settings menu, choose a language and press save.
The password must contain at least eight characters.
Your session expired; please sign in again.
The message was delivered, read and answered within an hour.
She smiled, waved goodbye and closed the door behind her.
The children laughed at the funny clown at the birthday party.
We watched the sunset from the top of the old tower.
The painter used bright colours to show the joy of the festival.
Reading every day improves vocabulary and concentration.
Learning a new language takes time, practice and patience.
He answered the phone and spoke quietly so as not to wake the baby.
The nurse checked the patient's temperature every four hours.
The machine makes a strange noise when it starts.
The engine of the car would not start on that cold morning.
A mechanic repaired the brakes and changed the oil.
The bridge was built in the last century and is still in use.
Trains, buses and trams connect the suburbs with the city centre.
Many people work from home on Fridays.
The office is on the third floor, next to the lift.
Lunch is served between twelve and two in the cafeteria.
The report is due next week, so we should start writing it now.
Could you send me the file by email, please?
Thanks for your message; I will reply as soon as possible.
Best regards, and have a nice weekend.
"""

# Short template sentences multiply the corpus into a few hundred lines of
# plausible text with numbers and names, cheaply and deterministically.
_SUBJECTS = (
    "The user",
    "The assistant",
    "The operator",
    "The server",
    "My friend",
    "The engineer",
    "Our team",
    "The customer",
    "The teacher",
    "The driver",
)
_PREDICATES = (
    "waited for {n} seconds before trying again.",
    "sent {n} messages this morning.",
    "asked about order number {n}.",
    "restarted the service at {n} o'clock.",
    "read {n} pages of the manual.",
    "counted {n} requests in the queue.",
    "answered {n} questions without a single error.",
    "walked {n} kilometres along the river.",
)


def training_lines() -> list[str]:
    lines = [line for line in _CORPUS.splitlines() if line]
    for i, subject in enumerate(_SUBJECTS):
        for j, predicate in enumerate(_PREDICATES):
            lines.append(f"{subject} {predicate.format(n=(i * 37 + j * 11) % 120 + 1)}")
    # Chat-formatted samples so role names and the newline after the role
    # header become single tokens, as in real ChatML tokenizers.
    for role, text in (("system", "You are a helpful assistant."), ("user", "Hello!")):
        lines.append(f"<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n")
    # Tool calls too, so their tags and JSON punctuation are a few tokens each.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    lines.extend([call] * 4)
    lines.append('{"answer": "yes"} {"answer": "no"} <tool_response>\nsunny\n</tool_response>')
    return lines
